"""What the tests share, imported as `support.<module>` (pytest puts tests/ on sys.path; launched runs get it through
PYTHONPATH=tests, `support.launch.child_env`). No test file imports another test file: shared code lives here.

- compare: bit-equal, allclose and relative-norm checks over tensors and dicts of tensors
- trainers: one tiny GRPOAccelTrainer builder, the generated batches and hook runs the parity tests share
- launch: run launch/train.py and process groups the way a user does, with the tests' environment
- rewards, nonfinite: reward functions launched runs import by path (`--rewards support.rewards:length_reward`)
- models, logprob_inputs, trl_matrix, memory: tiny models, kernel inputs, the TRL matrix's settings, malloc probes
"""
