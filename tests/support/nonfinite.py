"""A reward that turns the run non-finite from a given step: `--rewards support.nonfinite:length_then_nan` with
NAN_FROM_STEP=k in the environment. From the k-th reward call (step k: one generation batch per step) every RMSNorm
output computed with grad enabled is NaN, so the loss and gradients of step k and later are NaN, in every process
of a launch (a global forward hook, installed when the launch imports this module)."""

import os

import torch

from support.rewards import length_reward

_calls = [0]


def _poison(module, args, output):
    if (_calls[0] >= int(os.environ.get("NAN_FROM_STEP", "1000000")) and torch.is_grad_enabled()
            and type(module).__name__.endswith("RMSNorm")):
        return output * float("nan")
    return None


torch.nn.modules.module.register_module_forward_hook(_poison)


def length_then_nan(prompts, completions, **kwargs):
    _calls[0] += 1
    return length_reward(prompts, completions, **kwargs)
