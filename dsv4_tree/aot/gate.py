"""The gate: record the scenarios' launches, compile every spec and the controls, apply the limits.

    report = run_gate(("tiny", "flash-verify"), cache_dir=None)
    report.ok, report.table, report.rows

Recording needs TRITON_INTERPRET=1 in this process (set before triton is imported); compiling
happens in the worker process, without it."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from . import checks
from .compiler import compile_specs
from .controls import CONTROLS


@dataclass
class GateReport:
    rows: list  # checks.row per spec, scenario specs first, then the controls
    table: str
    verdict: str
    flagged: int  # scenario specs with a flag
    controls: list  # (name, expected flag, fired)
    record_s: float
    compile_s: float
    extra: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.flagged == 0 and all(fired for _, _, fired in self.controls)

    def text(self) -> str:
        ctl = "; ".join(f"{n} -> {f}: {'fires' if ok else 'DOES NOT FIRE'}" for n, f, ok in self.controls)
        return (f"{self.table}\n\n{self.verdict}; controls: {ctl}\nrecord {self.record_s:.0f} s, compile "
                f"{self.compile_s:.0f} s wall; gate {'PASS' if self.ok else 'FAIL'}")


def run_gate(scenarios, cache_dir=None, time_limit: float = checks.TIME_LIMIT, with_controls: bool = True,
             log=None) -> GateReport:
    from .scenarios import record

    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("recording launches needs TRITON_INTERPRET=1 in this process")
    say = log or (lambda msg: None)
    t0 = time.monotonic()
    recorded = record(scenarios, progress=lambda n, k, l: say(f"[aot] {n}: {k} specs, {l} launches"))
    record_s = time.monotonic() - t0
    specs = [s for s, _ in recorded]
    wheres = [w for _, w in recorded]
    ctl = CONTROLS if with_controls else []

    def progress(i, r):
        w = wheres[i] if i < len(wheres) else "control"
        say(f"[aot] {i + 1}/{len(specs) + len(ctl)} {r.spec.name} {r.status} {r.seconds:.1f}s "
            f"{checks.flags(r, w, time_limit) or 'clean'}")

    t1 = time.monotonic()
    # the compile bound plus room: a compile over time_limit is flagged, one far over it is killed
    results = compile_specs(specs + [s for s, _ in ctl], time_limit=max(2 * time_limit, 60), cache_dir=cache_dir,
                            progress=progress)
    compile_s = time.monotonic() - t1
    main, ctl_res = results[:len(specs)], results[len(specs):]
    table, verdict, flagged = checks.summary(main, wheres, time_limit)
    fired = [(s.name, want, want in checks.flags(r, "control", time_limit)) for (s, want), r in zip(ctl, ctl_res)]
    rows = [checks.row(r, w, time_limit) for r, w in zip(main, wheres)]
    rows += [checks.row(r, "control", time_limit) for r in ctl_res]
    return GateReport(rows, table, verdict, flagged, fired, record_s, compile_s)
