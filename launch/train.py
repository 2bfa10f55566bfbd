"""GRPO training entry point.

    accelerate launch --config_file accelerate_configs/cpu.yaml launch/train.py            # the demo
    accelerate launch --config_file accelerate_configs/h100_110k.yaml launch/train.py --model Qwen/Qwen3-8B
    python launch/train.py --config my_run.yaml --max_steps 10                              # one process

Any GRPOConfig / GRPOAccelConfig field is a flag (`--learning_rate 1e-4`) or a key of `--config`; the preset
(--preset, else the launching YAML's, else the detected GPU's) sets everything else (`grpo_accel/app/run_spec.py`).
`grpo-accel plan` takes the same flags and prints what this would run. Everything a run produces lands in
`runs/<run_name>/`: the adapter, checkpoints, metrics.csv, summary.json, reward_curve.png, resolved_config.json,
held-out completions before and after. A mistake the user can fix ends in one `error:` line and exit code 2.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:  # the shipped text: no torch, TRL or transformers to import for it
        from grpo_accel.app.train_help import print_help

        return print_help()
    from grpo_accel.core.upstream_noise import quiet_upstream

    with quiet_upstream():  # the lines the stack prints that a user cannot act on (core/upstream_noise.py)
        from grpo_accel.app.runner import main_guarded, train_from_argv

        return main_guarded(train_from_argv, argv)


if __name__ == "__main__":
    import faulthandler
    import signal

    # A run that seems stuck: `kill -USR1 <pid>` prints every thread's Python stack to stderr and the run goes on.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if not {"-h", "--help"} & set(sys.argv[1:]):
        from grpo_accel.app.bitsandbytes_gate import hide_unless_quantized

        # a run without 4-bit weights never imports bitsandbytes; for the whole process, so here, where the process
        # is the run's, not in main() (which tests call in their own process)
        hide_unless_quantized(sys.argv[1:])
    try:
        code = main()
    except KeyboardInterrupt:
        sys.exit(130)
    from grpo_accel.core.process_exit import exit_without_teardown

    # A run that ended (trained, or stopped with its `error:` line) skips the interpreter's teardown: freeing the
    # stack's modules is 2.5-6 s of a core per rank (core/process_exit.py). Our bugs' tracebacks exit normally.
    exit_without_teardown(code)
