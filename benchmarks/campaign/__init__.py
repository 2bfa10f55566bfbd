"""The GPU campaign's machinery, apart from the scripts that measure: run.py (the driver: rows in order, each in its
own process group and time limit, the ledger, the resume), rows.py (what each row measures, its goal, sizes and
limit), summary.py (the one-page measured-vs-goal summary), preflight.py (every import the rows need, in seconds),
serve.py (the `vllm serve` launcher), random_models.py (random checkpoints and a tokenizer made in code: no download
on a GPU host), and the loan's shell scripts (loan.sh: one call on a lent GPU; loan_wheels.sh and unsloth_wheels.sh:
the wheel sets it carries). Each claim's measuring script stays one file in benchmarks/ (bench_*.py, gpu_presets.py,
gemm_alignment.py) on the harness they and the campaign share (benchmarks/harness.py); docs/gpu-campaign.md tells how
a loan runs.
"""
