"""Generation for the trainer: colocated vLLM sharing the training model's weights (vllm_colocate.py), the choice of
engine, its size and seed, and the fallback to transformers' generate() (vllm_setup.py), whether vLLM is here at a
supported version (vllm_availability.py)."""
