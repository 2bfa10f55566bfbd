"""Generation's producers and the record they fill: the colocated engine sharing the training model's weights
(vllm_setup.py starts it, vllm_colocate.py is it, share_check.py checks the share, vllm_generation.py is TRL's
vllm_generation over it), transformers' continuous batching (continuous_batching.py), a `vllm serve` machine
(adapter_sync.py, server_generation.py, server_rollouts.py), --rollout_budget's rounds (rollout_budget.py), the
versioned rollout record (rollouts.py), the sampler's own MoE routing on continuous batching
(routing_capture.py), whether vLLM is here at a supported line (vllm_availability.py)."""
