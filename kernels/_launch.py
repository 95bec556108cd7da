"""Launcher checks shared by the kernels: shapes, strides, dtypes and device, before launch."""
from __future__ import annotations

import os

import torch

from dsv4_tree.errors import InputError


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_device(*tensors: torch.Tensor) -> torch.device:
    dev = tensors[0].device
    for t in tensors:
        if t.device != dev:
            raise InputError(f"kernel inputs on different devices: {t.device} vs {dev}")
    if dev.type == "cpu" and not interpreting():
        raise InputError("Triton kernels on CPU tensors need TRITON_INTERPRET=1 set before triton is imported")
    if dev.type not in ("cpu", "cuda"):
        raise InputError(f"Triton kernels run on cuda (or cpu under TRITON_INTERPRET=1), got {dev}")
    return dev


def check(name: str, t: torch.Tensor, dims: int, dtypes=None, contiguous: bool = True) -> None:
    if not isinstance(t, torch.Tensor):
        raise InputError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dim() != dims:
        raise InputError(f"{name} must be {dims}-D, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise InputError(f"{name} must have dtype in {dtypes}, got {t.dtype}")
    if contiguous and not t.is_contiguous():
        raise InputError(f"{name} must be contiguous (strides {t.stride()})")


def check_scale(scale) -> None:
    """A softmax / score scale must be a host number: reading a device scalar would sync the host."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise InputError(f"scale must be a Python float, got {type(scale).__name__}")


def check_index_query(q: torch.Tensor, weights: torch.Tensor, scale) -> tuple:
    """An indexer's queries [T, HI, D] (fp32 / bf16), per-head weights [T, HI] fp32 and host scale.
    -> (T, HI, D)."""
    check("q", q, 3, (torch.float32, torch.bfloat16))
    t, h, d = q.shape
    check_scale(scale)
    check("weights", weights, 2, (torch.float32,))
    if tuple(weights.shape) != (t, h):
        raise InputError(f"weights must be [T={t}, HI={h}], got {tuple(weights.shape)}")
    return t, h, d


# The indexer's and sparse decode's register option. ptxas may cap a kernel's registers for
# occupancy (at 128 or 168) and spill: the sm_90a gate (dsv4_tree/aot) found it under every Triton
# 3.6-3.9 (8-warp indexer and fp32 decode tiles at V4 dims, the grouped bf16 decode over bf16
# pools, the tiny test model's fp32 tiles: 4-24 bytes). Asking for every register (255, the
# sm_90 limit) keeps each of them spill-free (docs/gpu-check.md).
ALL_REGISTERS = {"maxnreg": 255}
FLOATS = (torch.float32, torch.bfloat16, torch.float16)
INDEX = (torch.int32, torch.int64)


def pow2(n: int, floor: int = 16) -> int:
    p = floor
    while p < n:
        p *= 2
    return p
