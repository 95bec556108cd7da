"""The meta device in the launchers: meta tensors hold shapes only, so a launcher on meta checks
its inputs, allocates its outputs and launches nothing (what every torch op does there). This
lets a whole verify step with the Triton backend run on meta at full size, to count the tensors
it allocates (tests/test_step_memory.py) without a GPU."""
from __future__ import annotations

import torch

from dsv4_tree.errors import InputError


def on_meta(*tensors: torch.Tensor) -> bool:
    """True when every tensor is on meta; InputError when only some are."""
    meta = [t.device.type == "meta" for t in tensors]
    if any(meta) and not all(meta):
        raise InputError(f"kernel inputs on different devices: {sorted({str(t.device) for t in tensors})}")
    return all(meta)
