"""Batch scaling of one verify call: aten ops per verify, host plan time, verify ms per request,
for bs requests of N-node topk-4 trees, on the trained checkpoint and on bench_verify's
Flash-shaped model, every request on its own synthetic committed cache (the trained model's
at 96..159 positions, the Flash model's at --context).

Ops are counted with dsv4_tree.diagnostics.OpCounter over one whole engine.verify call. Plan
time is engine.plan(requests, trees) (validation, page mapping, the batch's tables). Human
table first, a PNG when matplotlib is installed, and as the last line one JSON object."""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import dsv4_tree as dt
from dsv4_tree.diagnostics import OpCounter
from dsv4_tree.serving.synth import synthetic_request
from dsv4_tree.tree.simulate import eagle_tree

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_verify import bench_model  # noqa: E402  (the Flash-shaped model builder)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def median_s(fn, reps: int, device: str) -> float:
    times = []
    for _ in range(reps):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def requests(engine, count: int, context: int, spread: int):
    """count requests on synthetic committed caches (random rows in the structures a prefill
    fills; verify reads them only) of context + (13 b mod spread) positions: different P."""
    v = engine.model.vocab_size
    g = torch.Generator().manual_seed(0)
    return [synthetic_request(engine, context + (13 * b) % spread, seed=b,
                              root_token=int(torch.randint(2, v, (1,), generator=g))) for b in range(count)]


def measure(engine, reqs, n: int, reps: int, device: str, label: str):
    trees = [eagle_tree(r.root_token, n, topk=4, seed=b, vocab=engine.model.vocab_size) for b, r in enumerate(reqs)]
    engine.verify(reqs, trees)  # warm-up
    sync(device)
    with OpCounter() as ops:
        engine.verify(reqs, trees)
    sync(device)
    plan_s = median_s(lambda: engine.plan(reqs, trees), max(reps, 5), device)  # cheap: always a median of >= 5
    verify_s = median_s(lambda: engine.verify(reqs, trees), reps, device)
    return {"model": label, "N": n, "bs": len(reqs), "ops": ops.total, "plan_ms": 1e3 * plan_s,
            "verify_ms": 1e3 * verify_s, "verify_ms_per_request": 1e3 * verify_s / len(reqs)}


def spec_for(nodes, graph_bs, max_bs: int, context: int):
    """Pools sized for max_bs requests of up to context + 64 committed positions plus a tree."""
    kw = dict(eagle_topk=4, num_steps=16, num_draft_tokens=max(nodes), prefill_chunk=16, max_requests=max_bs,
              max_total_tokens=max_bs * (context + 64 + max(nodes)))
    if graph_bs is not None:
        kw["cuda_graph_max_bs"] = graph_bs
    return dt.SpecConfig(**kw)


def ratios(records):
    """Per (model, N): the issue's targets as measured ratios against bs = 1."""
    out = []
    for key in sorted({(r["model"], r["N"]) for r in records}):
        rs = {r["bs"]: r for r in records if (r["model"], r["N"]) == key}
        if 1 not in rs or len(rs) < 2:
            continue
        top = max(rs)
        out.append({"model": key[0], "N": key[1], "bs": top,
                    "ops_ratio": rs[top]["ops"] / rs[1]["ops"],
                    "plan_ratio": rs[top]["plan_ms"] / rs[1]["plan_ms"],
                    "ms_per_request_ratio": rs[top]["verify_ms_per_request"] / rs[1]["verify_ms_per_request"]})
    return out


def plot(records, path):
    try:
        import matplotlib
    except ImportError:
        return "plot: skipped (matplotlib is not installed)"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for key in sorted({(r["model"], r["N"]) for r in records}):
        rs = sorted((r for r in records if (r["model"], r["N"]) == key), key=lambda r: r["bs"])
        for ax, field in zip(axes, ("ops", "plan_ms", "verify_ms_per_request")):
            ax.plot([r["bs"] for r in rs], [r[field] for r in rs], marker="o", label=f"{key[0]} N={key[1]}")
    for ax, title in zip(axes, ("aten ops per verify", "host plan time (ms)", "verify ms per request")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("requests per verify (bs)")
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return f"plot: {path}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true",
                    help="bs 1,4,16 (Flash 1,4), N 8, one repetition; under ~2 minutes on 2 idle CPU cores")
    ap.add_argument("--bs", default=None, help="comma list of batch sizes (default 1,4,16,64)")
    ap.add_argument("--nodes", default=None, help="comma list of tree sizes (default 8,16)")
    ap.add_argument("--models", default="trained,flash", help="comma list of: trained, flash")
    ap.add_argument("--flash-bs", default=None, help="batch sizes on the Flash model (default: --bs; --quick: 1,4)")
    ap.add_argument("--context", type=int, default=4096,
                    help="committed context of the Flash model's requests (the trained model's: 96..159)")
    ap.add_argument("--layers", type=int, default=3, help="Flash model layers (cycling SWA, C4, C128)")
    ap.add_argument("--reps", type=int, default=None, help="timed verify repetitions (median)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, choices=("float32", "bfloat16"))
    ap.add_argument("--cuda-graph-max-bs", type=int, default=None,
                    help="pass SpecConfig(cuda_graph_max_bs=...) (only where SpecConfig has that field)")
    ap.add_argument("--plot", default="bench_out/bench_batch.png", help="PNG path ('' to skip)")
    args = ap.parse_args(argv)
    bss = [int(x) for x in (args.bs or ("1,4,16" if args.quick else "1,4,16,64")).split(",")]
    nodes = [int(x) for x in (args.nodes or ("8" if args.quick else "8,16")).split(",")]
    flash_bss = [int(x) for x in args.flash_bs.split(",")] if args.flash_bs else ([1, 4] if args.quick else bss)
    reps = args.reps or (1 if args.quick else 3)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if args.device.startswith("cuda") else torch.float32)
    machine = (torch.cuda.get_device_name() if args.device.startswith("cuda")
               else f"{platform.machine()} CPU, {torch.get_num_threads()} threads")
    records, timer = [], "engine.plan"
    for name in args.models.split(","):
        t0 = time.perf_counter()
        if name == "trained":
            spec = spec_for(nodes, args.cuda_graph_max_bs, max(bss), 96)
            engine = dt.Engine(dt.load_model(dt.trained_checkpoint(), device=args.device, dtype=dtype), spec)
            sizes, pool = bss, requests(engine, max(bss), 96, 64)
        elif name == "flash":
            spec = spec_for(nodes, args.cuda_graph_max_bs, max(flash_bss), args.context)
            engine = dt.Engine(bench_model(args.layers, args.device, dtype), spec)
            sizes, pool = flash_bss, requests(engine, max(flash_bss), args.context, 64)
        else:
            raise SystemExit(f"--models: unknown model {name!r} (known: trained, flash)")
        print(f"[{name}] model and {len(pool)} requests ready in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
        for n in nodes:
            for bs in sizes:
                rec = measure(engine, pool[:bs], n, reps, args.device, name)
                records.append(rec)
                print(f"[{name}] N={n} bs={bs}: {rec['ops']} ops, {rec['verify_ms_per_request']:.2f} ms/request",
                      file=sys.stderr, flush=True)
        del engine, pool
    print(f"machine: {machine}; torch {torch.__version__}; {dtype}; medians of {reps} verify repetitions "
          f"(plan: of {max(reps, 5)}); plan time = {timer}; flash context {args.context}, {args.layers} layers; "
          f"cuda_graph_max_bs={args.cuda_graph_max_bs}")
    print(f"{'model':>8} {'N':>3} {'bs':>4} {'ops':>8} {'ops/req':>8} {'plan_ms':>9} {'verify_ms':>10} {'ms/req':>8}")
    for r in records:
        print(f"{r['model']:>8} {r['N']:>3} {r['bs']:>4} {r['ops']:>8} {r['ops'] / r['bs']:>8.0f} {r['plan_ms']:>9.2f} "
              f"{r['verify_ms']:>10.1f} {r['verify_ms_per_request']:>8.2f}")
    summary = ratios(records)
    print("ratios against bs=1 (targets: ops <= 1.25, plan <= 4 at bs 64, ms/request <= 0.25 at bs 64 on trained):")
    for s in summary:
        print(f"  {s['model']} N={s['N']} bs={s['bs']}: ops x{s['ops_ratio']:.2f}, plan x{s['plan_ratio']:.2f}, "
              f"ms/request x{s['ms_per_request_ratio']:.3f}")
    print(plot(records, args.plot) if args.plot else "plot: skipped (--plot '')")
    print(json.dumps({"machine": machine, "device": args.device, "dtype": str(dtype), "plan_timer": timer,
                      "cuda_graph_max_bs": args.cuda_graph_max_bs, "reps": reps, "context": args.context,
                      "ratios": summary, "records": records}))


if __name__ == "__main__":
    main()
