"""Record the Triton launches of a block of code as KernelSpecs.

    with LaunchRecorder(run=DATA_KERNELS) as rec:
        engine.verify(requests, trees)      # every launch recorded, only the table build and moves run
    rec.specs                               # distinct KernelSpecs, first-seen order

Under TRITON_INTERPRET=1 every launch goes through `InterpretedFunction.run`; the recorder wraps
it, turns the launch's arguments into the spec an sm_90 GPU would compile (spec.Specialiser:
Triton's own binder), and then runs the launch if its kernel is in `run` (None: every kernel)
or returns without running it. Skipping the numeric kernels is valid for recording because a
spec depends on the arguments' dtypes, 16-alignment and integer values, which the launchers
take from shapes and host values, not from those kernels' outputs; it makes V4-Flash / V4-Pro
shapes cheap to record on a CPU. What the host or a later launch indexes with is still computed:
the device page updates run, and the step tables (the rows a prefill embeds, the slots
a commit moves) come from the torch table build, which tests/test_step_tables_kernel.py holds
bitwise equal to the table kernels (those are recorded, not run: interpreted, they took most of
a recording's time). For the same reason torch's dense products (linear, bmm, matmul, grouped mm) give zeros
of their own shape, dtype and device while recording (`_ShapeOnly`): at V4-Flash dims on a CPU
they cost minutes per step and their values reach no spec. `shapes_only=False` runs both for
real (tests/test_aot_record.py: the same specs either way).
`where` labels each spec with the scenario that first launched it."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode

from .spec import KernelSpec, Specialiser


@dataclass
class Recorded:
    spec: KernelSpec
    where: str  # the scenario label that first launched it
    launches: int = 0


# kernels whose outputs the host or later launches index with (the step tables, the device page
# tables they read): run even when recording. The rest (the commit's record moves and the
# compressor's row copies among them) move or compute numbers that nothing indexes with.
DATA_KERNELS = frozenset({"_rows_kernel", "_requests_kernel", "_apply_pages_kernel"})
# the step-table kernels (kernels/table_build.py step_tables): under shapes_only their tables come
# from the torch build instead
TABLE_KERNELS = frozenset({"_rows_kernel", "_requests_kernel"})
DENSE = ("linear", "bmm", "matmul", "mm", "_grouped_mm")  # torch functions _ShapeOnly answers with zeros


class _ShapeOnly(TorchFunctionMode):
    """torch's dense products return zeros of the shape, dtype and device they would have (the
    shape from the same call on meta tensors): no FLOPs."""

    def __init__(self):
        super().__init__()
        self._funcs = {getattr(torch, n, None) for n in DENSE} | {getattr(torch.Tensor, n, None) for n in DENSE}
        self._funcs |= {torch.nn.functional.linear}
        self._funcs.discard(None)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in self._funcs or "out" in kwargs:
            return func(*args, **kwargs)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        meta = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in args]
        try:
            like = func(*meta, **{k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})
        except (RuntimeError, NotImplementedError):  # no meta form at these dtypes (fp32 grouped mm): compute
            return func(*args, **kwargs)
        return torch.zeros(like.shape, dtype=like.dtype, device=tensors[0].device)


@dataclass
class LaunchRecorder:
    run: frozenset | None = DATA_KERNELS  # kernel names to execute (None: all)
    where: str = ""
    shapes_only: bool = True  # with run set: zeros from dense products, tables from the torch build
    seen: dict = field(default_factory=dict)  # spec key -> Recorded
    launches: int = 0

    @property
    def specs(self) -> list:
        return [r.spec for r in self.seen.values()]

    def __enter__(self) -> "LaunchRecorder":
        from triton.runtime.interpreter import InterpretedFunction

        if getattr(InterpretedFunction.run, "_recorder", None) is not None:
            raise RuntimeError("a LaunchRecorder is already active")
        self._specialise = Specialiser()
        self._original = InterpretedFunction.run
        recorder = self
        fast = self.shapes_only and self.run is not None
        runs = None if self.run is None else self.run - TABLE_KERNELS if fast else self.run

        def run(fn_self, *args, grid, warmup, **kwargs):
            if not warmup:
                recorder._record(fn_self.fn, args, kwargs, grid, getattr(fn_self, "kwargs", None))
            if warmup or runs is None or fn_self.fn.__name__ in runs:
                return recorder._original(fn_self, *args, grid=grid, warmup=warmup, **kwargs)
            return None

        run._recorder = self
        InterpretedFunction.run = run
        self._undo = []
        if fast:
            self._host_tables()
            mode = _ShapeOnly()
            mode.__enter__()
            self._undo.append(lambda: mode.__exit__(None, None, None))
        return self

    def _host_tables(self) -> None:
        """serving/step.py build_from launches the table kernels (recorded, not run), then returns
        the torch build's tables."""
        from dsv4_tree.serving import step

        original = step.build_from

        def build_from(inputs, shapes, device_pages, layout):
            kernels = device_pages.kernels
            if kernels is None:
                return original(inputs, shapes, device_pages, layout)
            original(inputs, shapes, device_pages, layout)  # the launches, recorded
            device_pages.kernels = None
            try:
                return original(inputs, shapes, device_pages, layout)
            finally:
                device_pages.kernels = kernels

        step.build_from = build_from
        self._undo.append(lambda: setattr(step, "build_from", original))

    def __exit__(self, *exc) -> None:
        from triton.runtime.interpreter import InterpretedFunction

        InterpretedFunction.run = self._original
        for undo in reversed(self._undo):
            undo()

    def _record(self, fn, args, kwargs, grid, jit_options=None) -> None:
        if callable(grid):
            raise NotImplementedError(f"{fn.__name__}: callable grids are not recorded")
        spec = self._specialise(fn, args, kwargs, grid, jit_options)
        rec = self.seen.setdefault(spec.key(), Recorded(spec, self.where))
        rec.launches += 1
        self.launches += 1
