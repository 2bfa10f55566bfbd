"""The application around the trainer: the CLI, the run spec (flags + preset), the runner, bitsandbytes kept out of
runs that do not quantize (bitsandbytes_gate.py), presets, start-up checks,
reports and wandb tracking."""
