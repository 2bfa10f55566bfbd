"""The TRL matrix's settings shared by test_trl_compat.py and test_moe.py: the savers switched on, the log keys not
compared (timings), and how two logged values compare."""

import math

# Ours only: every saver that runs on one CPU process, on (sequence parallelism needs several: docs/pairs.md).
SAVERS_ON = dict(logprob_impl="chunked", padding_free=True, offload_activations="true", offload_recompute_tokens=16,
                 share_prompt="true")
NOT_COMPARED = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second", "eval_runtime",
                "eval_samples_per_second", "eval_steps_per_second", "total_flos"}



def close(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        # abs_tol: a loss near zero is a difference of O(0.1) terms, summed in another order by another CPU's kernels
        # (iterations_entropy: -0.00292655 vs -0.00292671 on an AMD EPYC, 2026-11-26, 1.6e-7 apart)
        return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6)
    return a == b
