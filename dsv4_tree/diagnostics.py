"""Measuring tools for the verify forward: count dispatched aten ops, count kernel launches
(aten ops that launch a kernel + Triton launches), count host-to-device copies, forbid host syncs.

Both are `TorchDispatchMode`s, so they see every aten op that reaches a backend kernel (after
autograd and after composite ops decompose), which is what a GPU would launch one kernel for.

    with OpCounter() as ops:
        engine.verify(requests, trees)
    ops.total, ops.by_name.most_common(5)

    with LaunchCounter(device="meta") as launches:
        engine.verify(requests, trees)    # launches.total: what a GPU would launch
    launches.by_owner                     # keyed by LaunchCounter(owner=...)'s labels

    with HostToDeviceCounter() as h2d:
        engine.plan(requests, trees)      # h2d.copies == 1: one packed buffer per step

    with forbid_host_sync():
        engine.run_plan(plan, requests)   # raises StateError at the first host-reading op
"""
from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

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


# aten ops that never launch a kernel: views, allocations without a fill, metadata changes
_NO_KERNEL = frozenset(f"aten.{n}" for n in """view _unsafe_view _reshape_alias reshape unsqueeze squeeze
unsqueeze_ squeeze_ transpose t permute expand expand_as slice select alias as_strided detach unflatten
flatten split split_with_sizes chunk unbind view_as narrow diagonal view_as_real view_as_complex _conj
_neg_view lift_fresh set_ empty empty_like empty_strided new_empty new_empty_strided resize_""".split())


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


def _returns_an_input(name: str, args, kwargs, out) -> bool:
    """An out-of-place op whose every output shares storage with an input (`reshape`, `to`,
    `contiguous` that returned a view or the input itself): no kernel ran. Storage identity
    works on the meta device too."""
    if name.endswith("_"):
        return False
    outs = list(_tensors(out))
    if not outs:
        return False
    ins = {t.untyped_storage()._cdata for t in _tensors((args, kwargs))}
    return all(t.untyped_storage()._cdata in ins for t in outs)


@dataclass(frozen=True)
class Launch:
    """One kernel launch, as LaunchCounter's `owner` sees it (the Python stack is live then)."""

    name: str  # "aten.add", or "triton.<kernel function name>"
    triton: bool
    host: bool  # an aten op whose tensors all live on the CPU (False for a Triton launch)


class LaunchCounter(TorchDispatchMode):
    """Counts kernel launches inside the `with` block: every aten op that launches a kernel
    (views, allocations and ops that returned their input are not launches) plus every Triton
    kernel launch (compiled, or under TRITON_INTERPRET=1; the torch ops the interpreter runs to
    stage a kernel's arguments are not counted).

    device: the device the counted work runs on; when it is not the CPU (a GPU, or meta for the
        torch path), an aten op whose tensors all live on the CPU is host bookkeeping, not a launch.
        On a CPU run host and device tensors look alike: `owner` tells them apart.
    owner(launch) -> label, or None for host work; called at each launch, so it may read the stack.

    total: launches counted; by_owner / by_name: Counters of them; host: the ops left out as host work.
    While a LaunchCounter is active, Triton's `JITFunction.run` / `InterpretedFunction.run` are
    wrapped to report to it; the originals are back when the last one exits."""

    def __init__(self, device=None, owner: Callable[[Launch], str | None] | None = None):
        super().__init__()
        self.device = None if device is None else torch.device(device)
        self.owner = owner if owner is not None else (lambda launch: "all")
        self.total = 0
        self.host = 0
        self.by_owner: collections.Counter = collections.Counter()
        self.by_name: collections.Counter = collections.Counter()
        self._in_kernel = 0

    def __enter__(self):
        _TritonRuns.wrap()
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        if not any(isinstance(m, LaunchCounter) for m in _get_current_dispatch_mode_stack()):
            _TritonRuns.unwrap()
        return out

    def _record(self, launch: Launch) -> None:
        on_host = launch.host and self.device is not None and self.device.type != "cpu"
        label = None if on_host else self.owner(launch)
        if label is None:
            self.host += 1
            return
        self.total += 1
        self.by_owner[label] += 1
        self.by_name[launch.name] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = str(func.overloadpacket)
        if self._in_kernel or name in _NO_KERNEL or _returns_an_input(name, args, kwargs, out):
            return out
        self._record(Launch(name, False, all(t.device.type == "cpu" for t in _tensors((args, kwargs, out)))))
        return out


class _TritonRuns:
    """Wraps the `run` of Triton's compiled and interpreted kernels so that each launch reports
    to the active LaunchCounters (found on torch's dispatch-mode stack: no state kept here)."""

    @staticmethod
    def _classes():
        import importlib.util

        if importlib.util.find_spec("triton") is None:
            return ()
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction

        return (JITFunction, InterpretedFunction)

    @staticmethod
    def wrap() -> None:
        for cls in _TritonRuns._classes():
            if not hasattr(cls.run, "_unwrapped"):
                cls.run = _TritonRuns._counting(cls.run)

    @staticmethod
    def unwrap() -> None:
        for cls in _TritonRuns._classes():
            if hasattr(cls.run, "_unwrapped"):
                cls.run = cls.run._unwrapped

    @staticmethod
    def _counting(run):
        def counted_run(self, *args, grid, warmup, **kwargs):
            counters = [m for m in _get_current_dispatch_mode_stack() if isinstance(m, LaunchCounter)]
            if warmup or not counters:
                return run(self, *args, grid=grid, warmup=warmup, **kwargs)
            name = "triton." + getattr(getattr(self, "fn", None), "__name__", type(self).__name__)
            for c in counters:
                c._record(Launch(name, True, False))
                c._in_kernel += 1
            try:
                return run(self, *args, grid=grid, warmup=warmup, **kwargs)
            finally:
                for c in counters:
                    c._in_kernel -= 1

        counted_run._unwrapped = run
        return counted_run


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
    "aten.bincount": "output shape depends on tensor values (its largest one)",
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
    (`aten.nonzero`, `masked_select`, boolean-mask indexing or index_put, `unique`, `bincount`,
    `repeat_interleave` without `output_size`), or a copy from a non-CPU device to the host.

    The rule is applied to every tensor whatever its device, so a CPU run already fails where a
    GPU run would stall. Not seen: `Tensor.tolist()` / `.numpy()` of a CPU tensor read memory
    without dispatching an op (on a GPU tensor they dispatch the device->host copy and are seen)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reason = _sync_reason(func, args, kwargs)
        if reason is not None:
            raise StateError(f"host synchronisation inside forbid_host_sync(): {func} {reason}")
        return func(*args, **kwargs)


class HostReadCounter(TorchDispatchMode):
    """Counts host reads inside the `with` block: every op forbid_host_sync refuses (a scalar
    read, `aten.equal`, a data-dependent output shape, a device-to-host copy), plus
    `Tensor.tolist()` / `Tensor.numpy()`, which read a CPU tensor's memory without dispatching
    an op (on a GPU tensor they are the device-to-host copy). On a GPU each is a stream sync.

    total: reads counted; by_reason: Counter keyed by the op ("aten.nonzero", "Tensor.tolist");
    where: Counter keyed by (op, the innermost dsv4_tree frame "file:line") when `trace=True`."""

    _READS = ("tolist", "numpy")

    def __init__(self, trace: bool = False):
        super().__init__()
        self.total = 0
        self.by_reason: collections.Counter = collections.Counter()
        self.where: collections.Counter = collections.Counter()
        self.trace = trace
        self._saved: dict = {}
        self._depth = 0  # a tolist() of a tensor dispatches nothing on CPU; on meta it would: count once

    def _note(self, what: str) -> None:
        self.total += 1
        self.by_reason[what] += 1
        if self.trace:
            self.where[(what, _project_frame())] += 1

    def __enter__(self):
        def wrap(name, f):
            def read(t, *args, **kwargs):
                self._note(f"Tensor.{name}")
                self._depth += 1
                try:
                    return f(t, *args, **kwargs)
                finally:
                    self._depth -= 1
            return read

        self._saved = {name: getattr(torch.Tensor, name) for name in self._READS}
        for name, f in self._saved.items():
            setattr(torch.Tensor, name, wrap(name, f))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, f in self._saved.items():
            setattr(torch.Tensor, name, f)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self._depth and _sync_reason(func, args, kwargs) is not None:
            self._note(str(func.overloadpacket))
        return func(*args, **kwargs)


def _project_frame() -> str:
    """The innermost stack frame inside dsv4_tree (not this module): "path:line"."""
    import traceback

    for frame in reversed(traceback.extract_stack()):
        if "dsv4_tree" in frame.filename and not frame.filename.endswith("diagnostics.py"):
            return f"{frame.filename.split('dsv4_tree/')[-1]}:{frame.lineno}"
    return "?"


def host_values(t: torch.Tensor):
    """A numpy view of a tensor that lives in host memory on every machine (host bookkeeping
    such as per-request lengths, or a CPU-only code path): not a device read, so HostReadCounter
    does not count it. StateError for a tensor on another device, which would be one."""
    if t.device.type != "cpu":
        raise StateError(f"host_values of a {t.device.type} tensor: that is a device read")
    return torch._C.TensorBase.numpy(t.detach())
