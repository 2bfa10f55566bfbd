"""The fused log-prob head on an HF causal LM's forward (logprob_head.py), reachable through PEFT / DDP / DeepSpeed."""
