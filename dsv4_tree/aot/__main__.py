"""python -m dsv4_tree.aot [--full | --scenarios a,b] [--cache DIR] [--time-limit S] [--json FILE]

Records the library's launches (TRITON_INTERPRET=1, set here before triton is imported),
compiles each specialisation for sm_90a (an H200) in a worker without a GPU, prints the
per-kernel table, and exits 1 when a spec breaks a limit or a negative control does not fire."""
import argparse
import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")


def main(argv=None) -> int:
    from .checks import TIME_LIMIT
    from .gate import run_gate
    from .scenarios import FULL, QUICK, SCENARIOS

    ap = argparse.ArgumentParser(prog="python -m dsv4_tree.aot", description=__doc__.split("\n\n")[0])
    ap.add_argument("--full", action="store_true", help=f"every scenario ({', '.join(FULL)}); default {QUICK}")
    ap.add_argument("--scenarios", help="comma-separated scenario names")
    ap.add_argument("--cache", help="result cache directory (keyed by kernel source, spec and Triton version)")
    ap.add_argument("--time-limit", type=float, default=TIME_LIMIT, help="seconds per compile")
    ap.add_argument("--json", help="write every spec's row to this file")
    args = ap.parse_args(argv)
    names = args.scenarios.split(",") if args.scenarios else (FULL if args.full else QUICK)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        ap.error(f"unknown scenario(s) {unknown}; known: {', '.join(SCENARIOS)}")
    report = run_gate(names, cache_dir=args.cache, time_limit=args.time_limit,
                      log=lambda m: print(m, file=sys.stderr, flush=True))
    print(report.text())
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ok": report.ok, "verdict": report.verdict, "controls": report.controls, "rows": report.rows,
                       "record_s": report.record_s, "compile_s": report.compile_s}, f, indent=1)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
