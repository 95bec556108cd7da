"""What every trainer here does around its own loss: the learning-rate schedule (linear warmup,
cosine decay, floored at 2% of the peak), a frozen target whose parameters are given back as
they were, and the running mean the loss curves plot."""
from __future__ import annotations

import math

LR_FLOOR = 0.02  # of the peak learning rate


def set_lr(opt, step: int, peak: float, warmup: int, steps: int) -> None:
    """Step `step` (1-based) of `steps`: warmup to `peak` over `warmup` steps, cosine decay to
    0 at `steps`, never below LR_FLOOR x peak."""
    lr = peak * min(1.0, step / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, step / steps)))
    for group in opt.param_groups:
        group["lr"] = max(lr, peak * LR_FLOOR)


def freeze(module):
    """Turn off gradients of `module`'s parameters; returns the call that gives each its own
    requires_grad back (a trainer calls it in its `finally`: the caller's model as it was)."""
    flags = [(p, p.requires_grad) for p in module.parameters()]
    for p, _ in flags:
        p.requires_grad_(False)

    def restore() -> None:
        for p, flag in flags:
            p.requires_grad_(flag)

    return restore


def running_mean(values: list, window: int) -> list:
    """Mean of each value and the up to window - 1 before it."""
    return [sum(values[max(0, i - window + 1): i + 1]) / len(values[max(0, i - window + 1): i + 1])
            for i in range(len(values))]
