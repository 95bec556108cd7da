"""python -m dsv4_tree.aot [--full | --scenarios a,b] [--cache DIR] [--time-limit S] [--json FILE]
python -m dsv4_tree.aot --launch [--full | --scenarios a,b]      (on a machine with a GPU)

Records the library's launches (TRITON_INTERPRET=1, set here before triton is imported),
compiles each specialisation for sm_90a (an H200) in a worker without a GPU, prints the
per-kernel table, and exits 1 when a spec breaks a limit or a negative control does not fire.
The last line of stdout is one JSON object (the verdict, the controls, per-kernel worst numbers).
--launch instead runs the same scenarios on the GPU, every kernel compiled by the JIT and
launched once (no interpreter)."""
import argparse
import json
import os
import sys

import time

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")


def main(argv=None) -> int:
    from .checks import TIME_LIMIT
    from .scenarios import FULL, QUICK, SCENARIOS

    ap = argparse.ArgumentParser(prog="python -m dsv4_tree.aot", description=__doc__.split("\n\n")[0])
    ap.add_argument("--full", action="store_true", help=f"every scenario ({', '.join(FULL)}); default {QUICK}")
    ap.add_argument("--scenarios", help="comma-separated scenario names")
    ap.add_argument("--cache", help="result cache directory (keyed by kernel source, spec and Triton version)")
    ap.add_argument("--time-limit", type=float, default=TIME_LIMIT, help="seconds per compile")
    ap.add_argument("--json", help="write every spec's row to this file")
    ap.add_argument("--launch", action="store_true", help="run the scenarios' kernels on the GPU instead")
    args = ap.parse_args(argv)
    names = args.scenarios.split(",") if args.scenarios else (FULL if args.full else QUICK)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        ap.error(f"unknown scenario(s) {unknown}; known: {', '.join(SCENARIOS)}")
    if args.launch:
        return _launch(names)
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton: recording runs the interpreter
    from .gate import run_gate

    report = run_gate(names, cache_dir=args.cache, time_limit=args.time_limit,
                      log=lambda m: print(m, file=sys.stderr, flush=True))
    print(report.text())
    worst = {}
    for r in report.rows:
        w = worst.setdefault(r["kernel"], {"specs": 0, "reg": 0, "smem": 0, "spill_stores": 0, "seconds": 0.0,
                                           "min_mma": None, "flags": []})
        w["specs"] += 1
        for k in ("reg", "smem", "spill_stores", "seconds"):
            w[k] = max(w[k], r[k] or 0)
        w["min_mma"] = r["mma"] if w["min_mma"] is None else min(w["min_mma"], r["mma"] or 0)
        w["flags"] = sorted(set(w["flags"]) | set(r["flags"]))
    import triton

    print(json.dumps({"ok": report.ok, "triton": triton.__version__, "verdict": report.verdict, "controls": report.controls,
                      "record_s": round(report.record_s, 1), "compile_s": round(report.compile_s, 1), "kernels": worst}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ok": report.ok, "triton": triton.__version__, "verdict": report.verdict, "controls": report.controls, "rows": report.rows,
                       "record_s": report.record_s, "compile_s": report.compile_s}, f, indent=1)
    return 0 if report.ok else 1


def _launch(names) -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("--launch compiles for the GPU: run it without TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    import torch

    from .scenarios import launch

    if not torch.cuda.is_available():
        print("--launch needs a CUDA device", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    done = []
    launch(names, "cuda", progress=lambda n: (done.append(n), print(f"[aot] {n}: launched", file=sys.stderr, flush=True)))
    print(json.dumps({"ok": True, "launched": done, "device": torch.cuda.get_device_name(),
                      "seconds": round(time.monotonic() - t0, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
