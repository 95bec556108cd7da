"""Host work of one verify step and the op count of its device half, against context and batch.

The model has bench_verify.py's DeepSeek-V4-Flash attention shapes (one SWA, one C4 + indexer,
one C128 layer; bf16, FP8 pools) and lives on the meta device with every pool and table, so
op counts need no data. `host_ms` is Engine.plan without its device build (validation, page
mapping, packing, the one host-to-device copy): all a graphed step does on the host. The
device build is timed on this CPU instead (`build_cpu_ms`: the same step's tables computed by
CPU kernels from a CPU copy of the page tables; meta would time its Python shape functions),
and `plan_ms` = host_ms + build_cpu_ms is an eager step's plan with this CPU as the device.
`build_ops` are the aten ops of the device build, `forward_ops` those of Engine.run_plan. Requests sit on synthetic committed caches of
the given context (+ 13 b mod 64 positions: different P), one topk-4 tree of N nodes each.
Human table first, the targets as measured ratios, one JSON line last."""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

import dsv4_tree as dt
from dsv4_tree.diagnostics import HostToDeviceCounter, OpCounter
from dsv4_tree.hf_bindings import DeepseekV4ForCausalLM
from dsv4_tree.serving.step import build_from
from dsv4_tree.serving.synth import synthetic_request
from dsv4_tree.serving.tables import TokenPages
from dsv4_tree.tree.simulate import eagle_tree

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_verify import FLASH_ATTENTION  # noqa: E402


def meta_model(layers: int):
    kinds = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
    cfg = dt.tiny_config(**FLASH_ATTENTION, num_hidden_layers=layers, layer_types=[kinds[i % 3] for i in range(layers)],
                         mlp_layer_types=["moe"] * layers)
    with torch.device("meta"):
        hf = DeepseekV4ForCausalLM(cfg).eval().to(torch.bfloat16)
    hf.set_experts_implementation("batched_mm")  # transformers' eager experts loop reads nonzero() on the host
    return dt.load_model(hf)


def wrap_build(engine, fn):
    """Replace the runtime's device build by fn(orig, step) for a while (undo: unwrap)."""
    orig = type(engine.runtime).build.__get__(engine.runtime)
    engine.runtime.build = lambda step: fn(orig, step)


def unwrap(engine):
    engine.runtime.__dict__.pop("build", None)


def measure(engine, reqs, n: int, reps: int) -> dict:
    rt = engine.runtime
    trees = [eagle_tree(r.root_token, n, topk=4, seed=b, vocab=engine.model.vocab_size) for b, r in enumerate(reqs)]
    engine.run_plan(engine.plan(reqs, trees), reqs)  # warm-up: maps the draft pages, carries the synthetic ones
    seen = {}

    def counted(orig, step):
        with OpCounter() as ops:
            seen["tables"] = orig(step)
        seen["ops"], seen["step"] = ops.total, step
        return seen["tables"]

    wrap_build(engine, counted)
    with HostToDeviceCounter() as h2d:
        plan = engine.plan(reqs, trees)
    unwrap(engine)
    with OpCounter() as fwd:
        engine.run_plan(plan, reqs)
    wrap_build(engine, lambda orig, step: seen["tables"])  # host schedule only
    host = []
    for _ in range(5 * reps):  # cheap: a longer median against a noisy machine
        t = time.perf_counter()
        engine.plan(reqs, trees)
        host.append(time.perf_counter() - t)
    unwrap(engine)
    step = seen["step"]  # its page updates are already in the host tables the CPU copy is made of
    cpu_pages = SimpleNamespace(pages=TokenPages(rt.pages.req_to_page.to(torch.int32),
                                                 rt.pages.full_to_recent.to(torch.int32), rt.layout.page_size),
                                kernels=None)  # the torch build: the CPU time of its ops
    inputs = step.buffer[: 3 * step.shapes.requests + 2 * step.shapes.rows]
    build = []
    for _ in range(reps):
        t = time.perf_counter()
        build_from(inputs, step.shapes, cpu_pages, rt.layout)
        build.append(time.perf_counter() - t)
    host_ms, build_ms = 1e3 * statistics.median(host), 1e3 * statistics.median(build)
    return {"context": reqs[0].seq_len, "bs": len(reqs), "N": n, "host_ms": host_ms, "build_cpu_ms": build_ms,
            "plan_ms": host_ms + build_ms, "build_ops": seen["ops"], "forward_ops": fwd.total,
            "h2d_copies": h2d.copies, "h2d_bytes": h2d.bytes}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--contexts", default="4096,65536,262144,1048576")
    ap.add_argument("--bs", default="1,16,64")
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--reps", type=int, default=21, help="timed plans per case (median)")
    ap.add_argument("--quick", action="store_true", help="contexts 4096,65536; bs 1,4; 5 reps")
    args = ap.parse_args(argv)
    contexts = [4096, 65536] if args.quick else [int(x) for x in args.contexts.split(",")]
    sizes = [1, 4] if args.quick else [int(x) for x in args.bs.split(",")]
    reps = 5 if args.quick else args.reps
    torch.set_num_threads(1)
    model = meta_model(args.layers)
    spec = dt.SpecConfig(eagle_topk=4, num_steps=8, num_draft_tokens=max(8, args.nodes), prefill_chunk=64,
                         max_requests=max(sizes), max_total_tokens=max(sizes) * (max(contexts) + 256),
                         kv_cache_dtype="fp8_e4m3")
    engine = dt.Engine(model, spec)
    machine = f"{platform.machine()} {platform.processor() or 'CPU'}, torch {torch.__version__}, 1 thread"
    records = []
    for ctx in contexts:
        pool = [synthetic_request(engine, ctx + (13 * b) % 64, seed=b) for b in range(max(sizes))]
        for bs in sizes:
            rec = measure(engine, pool[:bs], args.nodes, reps)
            rec["context"] = ctx
            records.append(rec)
            print(f"ctx {ctx} bs {bs}: host {rec['host_ms']:.2f} ms, {rec['build_ops']} + {rec['forward_ops']} ops",
                  file=sys.stderr, flush=True)
        for r in pool:
            engine.release(r)
    print(f"machine: {machine}; model and tables on meta (host work only); bf16, FP8 pools; "
          f"{args.layers} layers (SWA, C4 + indexer, C128); topk-4 trees of N={args.nodes}; host: median of {5 * reps}, "
          f"build_cpu: median of {reps}")
    print(f"{'context':>8} {'bs':>3} {'host_ms':>8} {'build_cpu_ms':>12} {'plan_ms':>8} {'build_ops':>9} "
          f"{'forward_ops':>11} {'h2d':>4} {'h2d_KB':>7}")
    for r in records:
        print(f"{r['context']:>8} {r['bs']:>3} {r['host_ms']:>8.2f} {r['build_cpu_ms']:>12.2f} {r['plan_ms']:>8.2f} "
              f"{r['build_ops']:>9} {r['forward_ops']:>11} {r['h2d_copies']:>4} {r['h2d_bytes'] / 1024:>7.1f}")
    at = {(r["context"], r["bs"]): r for r in records}
    lo, hi, mid = min(contexts), max(contexts), 65536 if 65536 in contexts else contexts[-1]
    one, big = min(sizes), max(sizes)
    ratios = {
        f"host({hi})/host({lo}) bs {one}": at[hi, one]["host_ms"] / at[lo, one]["host_ms"],
        f"host(bs {big})/host(bs {one}) at {mid}": at[mid, big]["host_ms"] / at[mid, one]["host_ms"],
        f"plan({hi})/plan({lo}) bs {one}": at[hi, one]["plan_ms"] / at[lo, one]["plan_ms"],
        f"plan(bs {big})/plan(bs {one}) at {mid}": at[mid, big]["plan_ms"] / at[mid, one]["plan_ms"],
        f"ops({hi})/ops({lo}) bs {one}": (at[hi, one]["build_ops"] + at[hi, one]["forward_ops"])
        / (at[lo, one]["build_ops"] + at[lo, one]["forward_ops"]),
        f"ops(bs {big})/ops(bs {one}) at {mid}": (at[mid, big]["build_ops"] + at[mid, big]["forward_ops"])
        / (at[mid, one]["build_ops"] + at[mid, one]["forward_ops"]),
    }
    print("ratios (targets: plan over context <= 1.5, plan over batch <= 3, ops over context <= 1.1; "
          "host = plan without the device build, plan = host + the build on this CPU):")
    for k, v in ratios.items():
        print(f"  {k}: {v:.3f}")
    print(json.dumps({"machine": machine, "ratios": ratios, "records": records}))


if __name__ == "__main__":
    main()
