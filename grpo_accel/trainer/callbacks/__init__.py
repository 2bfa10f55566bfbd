"""TrainerCallbacks the trainer adds: non-finite guards, preemption, per-phase memory telemetry, learning signal.
Independent of each other; none imports the app."""
