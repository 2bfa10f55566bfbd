"""Kernels: fused log-prob head (torch chunked reference path and Triton)."""
