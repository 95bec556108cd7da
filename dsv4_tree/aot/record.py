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
shapes cheap to record on a CPU. The table build and the commit moves still run: the host
reads what they write (the rows a prefill embeds, the slots a commit moves).
`where` labels each spec with the scenario that first launched it."""
from __future__ import annotations

from dataclasses import dataclass, field

from .spec import KernelSpec, Specialiser


@dataclass
class Recorded:
    spec: KernelSpec
    where: str  # the scenario label that first launched it
    launches: int = 0


# kernels whose outputs the host or later launches index with: run even when recording
DATA_KERNELS = frozenset({"_rows_kernel", "_requests_kernel", "_apply_pages_kernel", "_move_kernel",
                          "_rows_copy_kernel"})


@dataclass
class LaunchRecorder:
    run: frozenset | None = DATA_KERNELS  # kernel names to execute (None: all)
    where: str = ""
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

        def run(fn_self, *args, grid, warmup, **kwargs):
            if not warmup:
                recorder._record(fn_self.fn, args, kwargs, grid)
            if warmup or recorder.run is None or fn_self.fn.__name__ in recorder.run:
                return recorder._original(fn_self, *args, grid=grid, warmup=warmup, **kwargs)
            return None

        run._recorder = self
        InterpretedFunction.run = run
        return self

    def __exit__(self, *exc) -> None:
        from triton.runtime.interpreter import InterpretedFunction

        InterpretedFunction.run = self._original

    def _record(self, fn, args, kwargs, grid) -> None:
        if callable(grid):
            raise NotImplementedError(f"{fn.__name__}: callable grids are not recorded")
        spec = self._specialise(fn, args, kwargs, grid)
        rec = self.seen.setdefault(spec.key(), Recorded(spec, self.where))
        rec.launches += 1
        self.launches += 1
