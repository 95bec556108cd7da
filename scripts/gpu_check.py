"""Run the GPU checks as subprocesses, each under a time limit, and write one report.

Steps, in priority order (a step that would start after --budget-s is spent is marked skipped):
  gpu_tests          pytest -m 'gpu or on_device' with DSV4_TREE_GPU=1 (kernels, device flow, CUDA graphs)
  aot_launch         python -m dsv4_tree.aot --launch: the gate's scenarios (tiny, V4-Flash N = 8 verify)
                     run on the GPU, every kernel JIT-compiled and launched once at those shapes
  aot_gate           python -m dsv4_tree.aot: the ahead-of-time sm_90a gate's summary (compiled on the
                     CPU: shared memory, spills, MMA, compile time per kernel; design_notes/aot-gate.md)
  bench_verify_64K   benchmarks/bench_verify.py, bf16 (+ --kv-cache-dtype fp8_e4m3 where supported)
  bench_verify_triton  bench_verify_64K with --backend triton (the Triton kernels)
  bench_batch        benchmarks/bench_batch.py, bf16
  cuda_graph         bench_batch eager vs --cuda-graph-max-bs 64 (where SpecConfig has the field)
  draft_graph        benchmarks/bench_draft_graphs.py: DSpark drafts eager vs captured per batch bucket
  bench_verify_256K, bench_verify_1M
--dry-run runs the same steps on CPU, fp32, at tiny shapes (one bench_verify context, 4K; the
gate on the tiny scenario alone; aot_launch is not available without a GPU), the
Triton step under TRITON_INTERPRET=1, and the test step without DSV4_TREE_GPU and on the
gpu-marked tests alone, which are collected and skipped (the `device` tests it adds on a GPU
are, on the CPU, the main suite's own)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# what docs/install.md tells a GPU user to install beside their CUDA torch: pip install "dsv4-tree[hf,triton]"
GPU_EXTRAS = ("hf", "triton")


def _versions(python: str) -> str:
    probe = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('torch'), m.version('triton'))"],
                           capture_output=True, text=True)
    return probe.stdout.strip() or f"(torch / triton not importable: {probe.stderr.strip()[-300:]})"


def install(python: str, wheels: str | None = None, dry_run: bool = False) -> str:
    """Install this checkout as docs/install.md says (`pip install "dsv4-tree[hf,triton]"`, with the
    checkout in place of the name; offline with --wheels: from that folder of wheels alone) into
    `python`'s environment, and fail when pip would change its torch or Triton: the CUDA torch a
    GPU user brings keeps its own Triton. Returns the torch / Triton versions."""
    before = _versions(python)
    cmd = [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-build-isolation",
           f"{ROOT}[{','.join(GPU_EXTRAS)}]"]
    if wheels:
        cmd += ["--no-index", "--find-links", wheels]
    if dry_run:
        cmd += ["--dry-run", "--report", "-"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"[gpu_check] {' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    if dry_run:
        touched = {i["metadata"]["name"].lower() for i in json.loads(proc.stdout)["install"]}
        if touched & {"torch", "triton"}:
            raise SystemExit(f"[gpu_check] installing would replace {sorted(touched & {'torch', 'triton'})} ({before})")
    elif _versions(python) != before:
        raise SystemExit(f"[gpu_check] installing changed torch / triton: {before} -> {_versions(python)}")
    return before


@dataclasses.dataclass
class Step:
    name: str
    cmd: list
    limit_s: float
    env: dict = dataclasses.field(default_factory=dict)
    cwd: str = str(ROOT)  # pytest runs elsewhere: `python -m` would import dsv4_tree from the checkout
    status: str = "pending"  # then: ok | failed | timeout | skipped | not available | not selected
    seconds: float = 0.0
    summary: str = ""
    result: dict | None = None  # a benchmark's last-line JSON
    tail: str = ""


def _text(x) -> str:
    return x.decode(errors="replace") if isinstance(x, bytes) else (x or "")


def run(step: Step, budget_end: float, log_dir: Path) -> None:
    """Run one step; fill status, seconds, summary, result (the JSON last line of stdout), tail."""
    limit = min(step.limit_s, budget_end - time.monotonic())
    if limit < 5:
        step.status, step.summary = "skipped", "time budget spent before this step"
        return
    t = time.monotonic()
    try:
        proc = subprocess.run(step.cmd, cwd=step.cwd, env={**os.environ, **step.env}, capture_output=True, text=True,
                              timeout=limit)
        stdout, stderr, rc = proc.stdout, proc.stderr, proc.returncode
        step.status = "ok" if rc == 0 else "failed"
    except subprocess.TimeoutExpired as exc:
        stdout, stderr, rc = _text(exc.stdout), _text(exc.stderr), None
        step.status = "timeout"
    step.seconds = time.monotonic() - t
    (log_dir / f"{step.name}.log").write_text(f"$ {' '.join(step.cmd)}\n{stdout}\n--- stderr ---\n{stderr}")
    step.tail = "\n".join((stdout + stderr).strip().splitlines()[-15:])
    last = ([ln for ln in stdout.splitlines() if ln.strip()] or [""])[-1]
    if step.name == "gpu_tests":
        lines = (stdout + stderr).splitlines()
        step.summary = next((ln.strip("= ") for ln in reversed(lines) if " in " in ln and
                             any(w in ln for w in ("passed", "skipped", "failed", "error"))), "")
    elif step.status == "ok":
        try:
            step.result = json.loads(last)
            step.summary = headline(step)
        except json.JSONDecodeError:
            step.status, step.summary = "failed", "the last line of stdout is not a JSON object"
    if step.status != "ok" and not step.summary:
        step.summary = f"exit code {rc}" if rc is not None else f"killed after {limit:.0f}s"


def headline(step: Step) -> str:
    r = step.result
    if r is None:
        return ""
    if step.name == "aot_gate":
        ctl = ", ".join(f"{n} fires" if ok else f"{n} DOES NOT FIRE" for n, _, ok in r["controls"])
        return f"{r['verdict']}; controls: {ctl}; compile {r['compile_s']:.0f}s"
    if step.name == "aot_launch":
        return f"launched on {r['device']}: {', '.join(r['launched'])}"
    if step.name == "draft_graph":
        return "; ".join(f"{x['case']} bs={x['bs']}: draft ms eager/captured x{x['draft_eager_over_captured']:.2f}"
                         f"{'' if x['same_tokens'] else ' (TOKENS DIFFER)'}" for x in r["ratios"])
    if step.name.startswith("bench_verify"):
        return (f"{r['context']} context, N={r['N']}: tree/chain {r['tree_over_chain']:.3f}, "
                f"per-path/tree {r['per_path_over_tree']:.2f}")
    return "; ".join(f"{x['model']} N={x['N']} bs={x['bs']}: ops x{x['ops_ratio']:.2f}, ms/request "
                     f"x{x['ms_per_request_ratio']:.3f}" for x in r.get("ratios", []))


def verify_supports(flag: str, py: str) -> bool:
    out = subprocess.run([py, "benchmarks/bench_verify.py", "--help"], cwd=ROOT, capture_output=True, text=True)
    return flag in out.stdout


def has_graph_field(py: str) -> bool:
    code = ("import dataclasses, dsv4_tree as dt; "
            "print('cuda_graph_max_bs' in {f.name for f in dataclasses.fields(dt.SpecConfig)})")
    return subprocess.run([py, "-c", code], cwd=ROOT, capture_output=True, text=True).stdout.strip() == "True"


def plan_steps(args, out: Path) -> list:
    py, dry = args.python, args.dry_run
    dev = ["--device", "cpu", "--dtype", "float32"] if dry else ["--device", "cuda", "--dtype", "bfloat16"]
    # the gpu-marked tests and every test on the `device` fixture (kernels, precision, device flow);
    # the dry run selects the gpu-marked ones alone (collected, skipped): on the CPU the `device`
    # tests are the main suite's own (107 s of CPU time, 4 whole-model runs in the Triton interpreter)
    tests = Step("gpu_tests", [py, "-m", "pytest", "-m", "gpu" if dry else "gpu or on_device", "-q", "-rs", "-p",
                               "no:cacheprovider", str(ROOT / "tests")], args.limit_tests,
                 {} if dry else {"DSV4_TREE_GPU": "1"}, cwd=str(out))
    fp8 = ["--kv-cache-dtype", "fp8_e4m3"] if verify_supports("--kv-cache-dtype", py) else []
    contexts = [("4K", 4096)] if dry else [("64K", 65536), ("256K", 262144), ("1M", 1 << 20)]
    size = ["--quick", "--nodes", "4", "--reps", "1"] if dry else ["--nodes", "8,16", "--reps", "3"]
    verify = [Step(f"bench_verify_{label}",
                   [py, "benchmarks/bench_verify.py", *dev, *fp8, *size, "--contexts", str(ctx),
                    "--plot", str(out / f"bench_verify_{label}.png")], args.limit_verify)
              for label, ctx in contexts]
    # the same 64K verify with the Triton kernels (the steps above use the torch reference ops);
    # the dry run uses tiny shapes, the interpreter being too slow for Flash-shaped layers
    triton_size = ["--quick", "--shapes", "tiny", "--nodes", "4", "--reps", "1", "--contexts", "1024"] if dry else \
        ["--nodes", "8,16", "--reps", "3", "--contexts", "65536"]
    # (on CPU Triton runs only through its interpreter, chosen before triton is imported)
    kernels = Step("bench_verify_triton", [py, "benchmarks/bench_verify.py", *dev, *fp8, "--backend", "triton",
                                           *triton_size, "--plot", ""], args.limit_verify,
                   {"TRITON_INTERPRET": "1"} if dry else {})
    tiny = ["--bs", "1,2", "--nodes", "4", "--flash-bs", "1", "--reps", "1", "--context", "1024"] if dry else []
    batch = Step("bench_batch", [py, "benchmarks/bench_batch.py", *dev, *tiny, "--plot", str(out / "bench_batch.png")],
                 args.limit_batch)
    graph_args = [py, "benchmarks/bench_batch.py", *dev, "--models", "trained", "--nodes", "4" if dry else "8",
                  "--bs", "1,2" if dry else "1,4,16,64", "--reps", "1" if dry else "5", "--plot", ""]
    graph = [Step("cuda_graph_eager", graph_args, args.limit_graph),
             Step("cuda_graph_replay", [*graph_args, "--cuda-graph-max-bs", "2" if dry else "64"], args.limit_graph)]
    if not has_graph_field(py):
        for g in graph:
            g.status, g.summary = "not available", "SpecConfig has no cuda_graph_max_bs field in this version"
    draft = Step("draft_graph", [py, "benchmarks/bench_draft_graphs.py", *dev, "--bs", "1,2" if dry else "1,4,16",
                                 "--reps", "1" if dry else "3", "--new-tokens", "8" if dry else "32"], args.limit_graph)
    aot_launch = Step("aot_launch", [py, "-m", "dsv4_tree.aot", "--launch"], args.limit_aot)
    if dry:
        aot_launch.status, aot_launch.summary = "not available", "needs a GPU (the dry run's gate records on the CPU)"
    aot_gate = Step("aot_gate", [py, "-m", "dsv4_tree.aot", *(["--scenarios", "tiny"] if dry else [])], args.limit_aot)
    return [tests, aot_launch, verify[0], kernels, batch, *graph, draft, *verify[1:], aot_gate]


def graph_ratios(steps) -> list:
    """verify ms per request, replay / eager, per bs (where both runs finished)."""
    eager, replay = (next(s for s in steps if s.name == n) for n in ("cuda_graph_eager", "cuda_graph_replay"))
    if eager.result is None or replay.result is None:
        return []
    e = {r["bs"]: r["verify_ms_per_request"] for r in eager.result["records"]}
    return [{"bs": r["bs"], "eager_ms_per_request": e[r["bs"]], "replay_ms_per_request": r["verify_ms_per_request"],
             "replay_over_eager": r["verify_ms_per_request"] / e[r["bs"]]}
            for r in replay.result["records"] if r["bs"] in e]


def table(header: list, rows: list) -> list:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + \
           ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def markdown(report: dict, steps) -> str:
    md = [f"# GPU check ({report['mode']})", "", f"machine: {report['machine']}; torch {report['torch']}; "
          f"python {report['python']}; started {report['started']}; {report['seconds']:.0f}s in all", ""]
    md += table(["step", "status", "seconds", "summary"], [(s.name, s.status, f"{s.seconds:.0f}", s.summary) for s in steps])
    for s in steps:
        r = s.result
        if r and s.name.startswith("bench_verify"):
            md += ["", f"## {s.name}", ""] + table(
                ["context", "N", "shape", "tree ms", "chain ms", "per-path ms", "tree/chain", "per-path/tree"],
                [(x["context"], x["N"], x["shape"], f"{1e3 * x['tree_s']:.1f}", f"{1e3 * x['chain_s']:.1f}",
                  f"{1e3 * x['per_path_s']:.1f}", f"{x['tree_over_chain']:.3f}", f"{x['per_path_over_tree']:.2f}")
                 for x in r["records"]])
        if r and s.name == "bench_batch":
            md += ["", "## bench_batch", "", f"plan time measured with {r['plan_timer']}", ""] + table(
                ["model", "N", "bs", "ops", "plan ms", "verify ms", "ms/request"],
                [(x["model"], x["N"], x["bs"], x["ops"], f"{x['plan_ms']:.2f}", f"{x['verify_ms']:.1f}",
                  f"{x['verify_ms_per_request']:.2f}") for x in r["records"]])
            md += ["", "ratios against bs = 1: " + "; ".join(
                f"{x['model']} N={x['N']} bs={x['bs']}: ops x{x['ops_ratio']:.2f}, plan x{x['plan_ratio']:.2f}, "
                f"ms/request x{x['ms_per_request_ratio']:.3f}" for x in r["ratios"])]
    if report["cuda_graph"]:
        md += ["", "## CUDA-graph replay vs eager (trained checkpoint)", ""] + table(
            ["bs", "eager ms/request", "replay ms/request", "replay/eager"],
            [(g["bs"], f"{g['eager_ms_per_request']:.3f}", f"{g['replay_ms_per_request']:.3f}",
              f"{g['replay_over_eager']:.3f}") for g in report["cuda_graph"]])
    for s in steps:
        r = s.result
        if r and s.name == "aot_gate":
            md += ["", "## aot_gate (sm_90a, compiled on the CPU)", "", r["verdict"], ""] + table(
                ["kernel", "specs", "max REG", "max smem KB", "max spill B", "min MMA", "max compile s", "flags"],
                [(k, x["specs"], x["reg"], f"{x['smem'] / 1024:.1f}", x["spill_stores"], x["min_mma"],
                  f"{x['seconds']:.0f}", ", ".join(x["flags"]) or "clean") for k, x in sorted(r["kernels"].items())])
    for s in steps:
        if s.status in ("failed", "timeout"):
            md += ["", f"## {s.name}: {s.status}", "", "```", s.tail, "```"]
    return "\n".join(md) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory for report.md, report.json, logs/ and plots")
    ap.add_argument("--dry-run", action="store_true", help="CPU, fp32, tiny shapes: checks the script end to end")
    ap.add_argument("--python", default=sys.executable, help="interpreter for the steps")
    ap.add_argument("--only", default="", help="comma list of step names to run (the others are reported 'not selected' and do not fail the run)")
    ap.add_argument("--budget-s", type=float, default=540, help="wall-clock budget for all steps")
    ap.add_argument("--limit-tests", type=float, default=150)
    ap.add_argument("--limit-verify", type=float, default=120, help="per bench_verify context")
    ap.add_argument("--limit-batch", type=float, default=180)
    ap.add_argument("--limit-graph", type=float, default=90, help="per run (eager, replay)")
    ap.add_argument("--limit-aot", type=float, default=300, help="per aot step (launch, gate)")
    ap.add_argument("--install", action="store_true",
                    help='first install this checkout as docs/install.md says ("dsv4-tree[hf,triton]") beside the torch there')
    ap.add_argument("--wheels", help="with --install: a folder of wheels to install from, offline (pip --no-index)")
    args = ap.parse_args(argv)
    if args.wheels and not args.install:
        ap.error("--wheels goes with --install")
    if args.install:
        print(f"[gpu_check] installed beside torch / triton {install(args.python, args.wheels)}", file=sys.stderr)
    out = Path(args.out).resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    probe = subprocess.run([args.python, "-c", "import torch; print(torch.__version__, torch.version.cuda, "
                            "torch.cuda.get_device_name() if torch.cuda.is_available() else '')"],
                           capture_output=True, text=True)
    torch_ver, cuda_ver, gpu = (probe.stdout.split(" ", 2) + ["", "", ""])[:3]
    gpu = gpu.strip()
    started, t0 = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), time.monotonic()
    steps = plan_steps(args, out)
    unknown = sorted(set(filter(None, args.only.split(","))) - {s.name for s in steps})
    if unknown:
        ap.error(f"--only names unknown steps {unknown}; the steps are {[s.name for s in steps]}")
    for s in steps:
        if s.status != "pending":
            continue
        if args.only and s.name not in args.only.split(","):
            s.status, s.summary = "not selected", "--only names other steps"
        elif not args.dry_run and not gpu:
            s.status, s.summary = "skipped", f"no CUDA device visible to {args.python} (torch {torch_ver}, CUDA {cuda_ver})"
        else:
            run(s, t0 + args.budget_s, out / "logs")
            print(f"[gpu_check] {s.name}: {s.status} in {s.seconds:.0f}s {s.summary}", file=sys.stderr, flush=True)
    machine = gpu or f"{platform.machine()} CPU, {os.cpu_count()} cores"
    report = {"mode": "dry-run" if args.dry_run else "gpu", "machine": machine, "torch": torch_ver, "cuda": cuda_ver,
              "python": args.python, "started": started, "seconds": time.monotonic() - t0,
              "steps": [dataclasses.asdict(s) for s in steps], "cuda_graph": graph_ratios(steps)}
    (out / "report.json").write_text(json.dumps(report, indent=1))
    (out / "report.md").write_text(markdown(report, steps))
    print(f"[gpu_check] report: {out / 'report.md'}", file=sys.stderr)
    return 0 if all(s.status in ("ok", "not available", "not selected") for s in steps) else 1


if __name__ == "__main__":
    sys.exit(main())
