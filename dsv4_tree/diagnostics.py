"""Measuring tools for the verify forward: count dispatched aten ops, count host-to-device
copies, forbid host syncs.

Both are `TorchDispatchMode`s, so they see every aten op that reaches a backend kernel (after
autograd and after composite ops decompose), which is what a GPU would launch one kernel for.

    with OpCounter() as ops:
        engine.verify(requests, trees)
    ops.total, ops.by_name.most_common(5)

    with HostToDeviceCounter() as h2d:
        engine.plan(requests, trees)      # h2d.copies == 1: one packed buffer per step

    with forbid_host_sync():
        engine.run_plan(plan, requests)   # raises StateError at the first host-reading op
"""
from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .errors import StateError


class OpCounter(TorchDispatchMode):
    """Counts aten ops dispatched inside the `with` block.

    total:   number of ops.
    by_name: collections.Counter keyed by overload packet ("aten.mm", "aten.index_select")."""

    def __init__(self):
        super().__init__()
        self.total = 0
        self.by_name: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.total += 1
        self.by_name[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


class HostToDeviceCounter(TorchDispatchMode):
    """Counts copies from host (CPU) memory to another device inside the `with` block
    (`aten._to_copy` / `aten.copy_` with a CPU source and a non-CPU destination); on the meta
    device they count as they would on a GPU. copies: the count; bytes: their payload."""

    def __init__(self):
        super().__init__()
        self.copies = 0
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        moved = _host_to_device(str(func.overloadpacket), args, kwargs)
        if moved is not None:
            self.copies += 1
            self.bytes += moved.numel() * moved.element_size()
        return func(*args, **kwargs)


def _host_to_device(name, args, kwargs):
    """The host tensor an op copies to another device, or None. `aten.to` reaches dispatch
    in inference mode, `aten._to_copy` / `aten.copy_` outside it."""
    if name in ("aten._to_copy", "aten.to") and isinstance(args[0], torch.Tensor):
        src, dst = args[0], kwargs.get("device")
        for a in args[1:]:
            if isinstance(a, (torch.device, str)):
                dst = a
            elif isinstance(a, torch.Tensor):
                dst = a.device
    elif name == "aten.copy_":
        src, dst = args[1], _device_of(args[0])
    else:
        return None
    if src.device.type == "cpu" and dst is not None and torch.device(dst).type != "cpu":
        return src
    return None


# ops whose result the host must wait for: a scalar read, or an output shape that depends on
# tensor values (the host must read it to allocate the output)
_HOST_READING = {
    "aten._local_scalar_dense": "reads a tensor value on the host (.item(), int(t), float(t), bool(t))",
    "aten.item": "reads a tensor value on the host",
    "aten.equal": "returns a Python bool computed from tensor values",
    "aten.is_nonzero": "returns a Python bool computed from a tensor value",
    "aten.nonzero": "output shape depends on tensor values",
    "aten.masked_select": "output shape depends on tensor values",
    "aten._unique": "output shape depends on tensor values",
    "aten._unique2": "output shape depends on tensor values",
    "aten.unique_dim": "output shape depends on tensor values",
    "aten.unique_consecutive": "output shape depends on tensor values",
}


def _device_of(x) -> torch.device | None:
    return x.device if isinstance(x, torch.Tensor) else None


def _sync_reason(func, args, kwargs) -> str | None:
    """Why `func(*args, **kwargs)` synchronises the host, or None."""
    name = str(func.overloadpacket)
    if name in _HOST_READING:
        return _HOST_READING[name]
    if name in ("aten.index", "aten.index_put", "aten.index_put_", "aten._index_put_impl_") and any(
        isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ())
    ):
        return "boolean-mask indexing: output shape depends on tensor values"
    if name == "aten.repeat_interleave" and isinstance(args[0], torch.Tensor) and kwargs.get("output_size") is None:
        if len(args) == 1 or isinstance(args[1], torch.Tensor):
            return "repeat_interleave with tensor repeats and no output_size: output shape depends on values"
    if name in ("aten._to_copy", "aten.to"):  # aten.to reaches dispatch in inference mode
        src, dst = _device_of(args[0]), kwargs.get("device")
        if src is not None and dst is not None and src.type != "cpu" and torch.device(dst).type == "cpu":
            return f"copies a {src.type} tensor to the host"
    if name == "aten.copy_":
        dst, src = _device_of(args[0]), _device_of(args[1])
        if dst is not None and src is not None and dst.type == "cpu" and src.type != "cpu":
            return f"copies a {src.type} tensor to the host"
    return None


class forbid_host_sync(TorchDispatchMode):
    """Raises dsv4_tree.errors.StateError, naming the op, when an op inside the block would make
    the host wait for the device: a scalar read (`aten._local_scalar_dense`, behind `.item()`,
    `int(t)`, `bool(t)`), `aten.equal`, an op whose output shape depends on tensor values
    (`aten.nonzero`, `masked_select`, boolean-mask indexing or index_put, `unique`, `repeat_interleave`
    without `output_size`), or a copy from a non-CPU device to the host.

    The rule is applied to every tensor whatever its device, so a CPU run already fails where a
    GPU run would stall. Not seen: `Tensor.tolist()` / `.numpy()` of a CPU tensor read memory
    without dispatching an op (on a GPU tensor they dispatch the device->host copy and are seen)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reason = _sync_reason(func, args, kwargs)
        if reason is not None:
            raise StateError(f"host synchronisation inside forbid_host_sync(): {func} {reason}")
        return func(*args, **kwargs)
