"""Kernels with their float64 references: the fused log-prob head (torch chunked path and Triton), the mass a
truncating sampler keeps (truncation.py). No TRL, no
trainer state: what these compute is checked against `logprobs_reference` on fresh random inputs."""
