"""The fused log-prob head on an HF causal LM's forward (logprob_head.py), reachable through PEFT / DDP / DeepSpeed;
the router loss taken once over packed forwards (router_loss.py); MoE routing replay on the routers
(routing_replay.py)."""
