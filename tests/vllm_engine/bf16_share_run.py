"""One bf16 engine on the embedded SmolLM2-135M-Instruct, its training model built around its weights: a JSON line
`BF16_SHARE {...}` with the share's checks and the host memory the build took (test_vllm_bf16.py). A process of its
own: the tier's session engine (conftest.engine) is fp32, and one engine per process."""

import json
import os
import sys

import torch


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    from grpo_accel.data.models import embedded_model_dir
    from grpo_accel.generation.vllm_colocate import EngineConfig, SharedVLLM, shared_fraction

    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    cfg = EngineConfig(dtype=torch.bfloat16, max_model_len=256, max_num_seqs=4, max_lora_rank=16,
                       kv_cache_bytes=2**28, num_threads=threads)
    engine = SharedVLLM(str(embedded_model_dir()), cfg)
    before = rss_bytes()
    model = engine.build_training_model()
    growth = rss_bytes() - before
    a = engine.agreement
    print("BF16_SHARE " + json.dumps(dict(
        shared=engine.shared, refusal=engine.refusal, shared_fraction=shared_fraction(model, engine.llm),
        dtypes=sorted({str(p.dtype) for p in model.parameters()}), difference=a and a.difference,
        hf_rounding=a and a.hf_rounding, bound=a and a.bound, ok=a and a.ok, agreement=str(a),
        rss_growth_bytes=growth, model_bytes=sum(p.numel() * p.element_size() for p in model.parameters()))),
        flush=True)


if __name__ == "__main__":
    main()
