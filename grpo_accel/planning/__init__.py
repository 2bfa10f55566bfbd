"""The memory planner (memory.py, its per-layer activation model activations.py, the generation phase's terms and
the engine's sizing generation.py), the generation routes (routes.py)
and the architectures table (architectures.py): a run's per-device bytes before any download.
Imports only core and ops' block planning: it plans runs for other machines."""
