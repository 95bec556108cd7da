"""dtype casts that dispatch nothing when the tensor already has the dtype.

`t.to(dtype)` / `t.float()` on a tensor of that dtype returns it, but in inference mode it is
still a dispatched op (~1 us on the CPU path); the mHC helpers, RoPE tables, pool reads and the
reference attention make dozens of such casts per decode step."""
from __future__ import annotations

import torch


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def f32(t: torch.Tensor) -> torch.Tensor:
    return as_dtype(t, torch.float32)
