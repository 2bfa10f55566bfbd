"""The application around the trainer: the CLI, the run spec (flags + preset), the runner, presets, start-up checks,
reports and wandb tracking."""
