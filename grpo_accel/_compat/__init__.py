"""Workarounds for upstream bugs and gaps, each naming the upstream version that needs it and what removes it.
Imports only grpo_accel.core."""
