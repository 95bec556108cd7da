"""Long-context verify: tree vs chain (same rows) vs per-path (each root-to-leaf path as its own
chain), on a model with DeepSeek-V4-Flash attention shapes and synthetic committed caches.

Each case also prints the KV bytes its kernels must read and its physical floor on an H200
(benchmarks/roofline.py: bf16 weights once, the KV a step must read, FLOPs; over 4.3 TB/s and
~790 TFLOP/s) and the measured tree time over it. Each tree size N runs on its own engine with
num_draft_tokens = N, so a bucketed (CUDA-graphed) step pads a request to N rows, not to the
largest N of the run.
Human table first, a PNG plot, and as the last line one JSON object (headline: N=8 topk-4 tree
at 64K context, or the largest context run)."""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import dsv4_tree as dt
from dsv4_tree.serving.synth import committed_bytes, synthetic_request
from dsv4_tree.checkpoint.tiny import random_model
from dsv4_tree.tree.simulate import eagle_tree

sys.path.insert(0, str(Path(__file__).resolve().parent))
from roofline import HBM_BYTES_PER_S, step_floor  # noqa: E402

FLASH_ATTENTION = dict(
    vocab_size=1024, hidden_size=4096, num_attention_heads=64, num_key_value_heads=1, head_dim=512,
    partial_rotary_factor=64 / 512, q_lora_rank=1024, o_groups=8, o_lora_rank=1024, sliding_window=128,
    index_n_heads=64, index_head_dim=128, index_topk=512, hc_mult=4,
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    # the MoE is not what this measures: keep it small
    n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=256,
    max_position_embeddings=1 << 21,
)


# --shapes tiny: the shipped tiny config's attention (for smoke runs and tests, seconds on CPU)
TINY_ATTENTION = dict(vocab_size=1024, max_position_embeddings=1 << 21)


def bench_model(layers: int, device: str, dtype, shapes: str = "flash"):
    kinds = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
    types = [kinds[i % 3] for i in range(layers)]
    attention = FLASH_ATTENTION if shapes == "flash" else TINY_ATTENTION
    cfg = dt.tiny_config(**attention, num_hidden_layers=layers, layer_types=types,
                         mlp_layer_types=["moe"] * layers)
    return dt.load_model(random_model(cfg, seed=0), device=device, dtype=dtype)


def bench_engine(model, n: int, max_context: int, kv_cache_dtype: str, backend: str):
    """An engine for trees of n nodes (num_draft_tokens = n): a bucketed step pads each request
    to n rows, so an "N = 8" case verifies 8 rows per request, not the run's largest N."""
    spec = dt.SpecConfig(eagle_topk=4, num_steps=n, num_draft_tokens=n, prefill_chunk=64, max_requests=2,
                         max_total_tokens=max_context + 1024, kv_cache_dtype=kv_cache_dtype, attention_backend=backend)
    return dt.Engine(model, spec)


class PeakMemory:
    """Peak bytes above the starting level during a block: CUDA allocator stats on GPU, the
    process's peak resident set (reset through /proc/self/clear_refs) on CPU."""

    def __init__(self, device):
        self.cuda = device.startswith("cuda")

    def __enter__(self):
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.base = self._status("VmRSS")
        return self

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.base
        else:
            self.peak = max(0, self._status("VmHWM") - self.base)

    @staticmethod
    def _status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
        raise RuntimeError(key)


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_case(engine, req, tree, device, reps):
    chain = dt.DraftTree.chain(torch.cat([tree.tokens[:1], torch.randint(2, 1000, (tree.num_nodes - 1,))]))
    paths = [dt.DraftTree.chain(tree.path_tokens(int(leaf))) for leaf in tree.leaves]
    providers = {
        "tree": lambda: engine.verify([req], [tree]),
        "chain": lambda: engine.verify([req], [chain]),
        "per_path": lambda: [engine.verify([req], [p]) for p in paths],
    }
    times = {k: [] for k in providers}
    mem = {}
    providers["tree"]()  # first call after a new cache pays one-time allocations
    for name, fn in providers.items():  # warm-up, and peak memory of one call
        with PeakMemory(device) as pm:
            fn()
            sync(device)
        mem[name] = pm.peak
    for _ in range(reps):  # interleaved repetitions
        for name, fn in providers.items():
            sync(device)
            t = time.perf_counter()
            fn()
            sync(device)
            times[name].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    path_rows = sum(int(tree.depth[leaf]) + 1 for leaf in tree.leaves)
    return med, mem, len(paths), path_rows / tree.num_nodes


def _reexec_for_honest_rss():
    """On CPU, make glibc mmap (and so return on free) every allocation >= 64 KiB, so the
    process's resident set follows live tensor memory and peak RSS measures a call's peak."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None and sys.platform.startswith("linux"):
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
        os.execve(sys.executable, [sys.executable, *sys.argv], env)


def main(argv=None):
    if argv is None and "cuda" not in " ".join(sys.argv):
        _reexec_for_honest_rss()
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="small contexts and sizes; under a minute on 2 CPU cores")
    ap.add_argument("--contexts", default=None, help="comma list, e.g. 16384,65536,262144")
    ap.add_argument("--nodes", default=None, help="comma list of tree sizes, e.g. 1,4,8,16,32,64")
    ap.add_argument("--layers", type=int, default=3, help="decoder layers (cycling SWA, C4, C128)")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions per provider")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, choices=("float32", "bfloat16"))
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "bfloat16", "fp8_e4m3"),
                    help="pool storage of K=V rows and compressed entries")
    ap.add_argument("--backend", default="torch", choices=("torch", "triton"), help="SpecConfig.attention_backend")
    ap.add_argument("--shapes", choices=("flash", "tiny"), default="flash",
                    help="flash: DeepSeek-V4-Flash attention shapes; tiny: the tiny test config (smoke runs)")
    ap.add_argument("--plot", default="bench_out/bench_verify.png",
                    help="PNG path ('' to skip); needs matplotlib (the `bench` extra), skipped with a note without it")
    args = ap.parse_args(argv)
    if args.quick:
        contexts, nodes, reps = [4096, 16384], [8], args.reps or 1
    else:
        contexts = [16384, 65536, 262144]
        nodes, reps = [1, 4, 8, 16, 32, 64], args.reps or 3
    if args.contexts:
        contexts = [int(x) for x in args.contexts.split(",")]
    if args.nodes:
        nodes = [int(x) for x in args.nodes.split(",")]
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if args.device.startswith("cuda") else torch.float32)
    t0 = time.perf_counter()
    model = bench_model(args.layers, args.device, dtype, args.shapes)

    machine = (torch.cuda.get_device_name() if args.device.startswith("cuda")
               else f"{platform.machine()} CPU, {torch.get_num_threads()} threads")
    what = ("64 heads x 512, window 128, C4 + indexer 64x128 top-512, C128" if args.shapes == "flash"
            else "tiny test shapes")
    print(f"machine: {machine}; torch {torch.__version__}; {dtype}; kv {args.kv_cache_dtype}; {args.backend} backend; "
          f"{args.layers} layers ({what}); model built in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    records = []
    header = (f"{'ctx':>7} {'N':>3} {'shape':>5} {'leaves':>6} {'R':>5} {'tree_ms':>9} {'chain_ms':>9} "
              f"{'path_ms':>9} {'tree/chain':>10} {'path/tree':>9} {'tree_MB':>8} {'chain_MB':>8} "
              f"{'read_MB':>8} {'floor_ms':>9} {'tree/floor':>10}")
    lines = []
    for n in nodes:  # one engine per tree size: a bucketed (graphed) step verifies the N it says
        engine = bench_engine(model, n, max(contexts), args.kv_cache_dtype, args.backend)
        for ctx in contexts:
            req = synthetic_request(engine, ctx, seed=ctx)
            base = committed_bytes(engine, ctx)
            for shape in (("tree", "chain") if n > 1 and not args.quick else ("tree",)):
                tree = eagle_tree(5, n) if shape == "tree" else dt.DraftTree.chain([5] + list(range(2, n + 1)))
                med, mem, leaves, r = run_case(engine, req, tree, args.device, reps)
                floor = step_floor(engine, [ctx], [tree.num_nodes])
                rec = {"context": ctx, "N": n, "shape": "topk4" if shape == "tree" else "chain", "leaves": leaves,
                       "path_rows_over_n": r, "tree_s": med["tree"], "chain_s": med["chain"],
                       "per_path_s": med["per_path"], "tree_over_chain": med["tree"] / med["chain"],
                       "per_path_over_tree": med["per_path"] / med["tree"], "tree_peak_bytes": mem["tree"],
                       "chain_peak_bytes": mem["chain"], "cache_bytes": base,
                       "extra_mem_frac": (mem["tree"] - mem["chain"]) / (base + mem["chain"]),
                       "kv_read_bytes": floor.kv_s * HBM_BYTES_PER_S,
                       "floor_s": floor.seconds, "floor_weights_s": floor.weights_s, "floor_kv_s": floor.kv_s,
                       "floor_flops_s": floor.flops_s, "tree_over_floor": med["tree"] / floor.seconds}
                records.append(rec)
                line = (f"{ctx:>7} {n:>3} {rec['shape']:>5} {leaves:>6} {r:>5.2f} {1e3 * med['tree']:>9.1f} "
                        f"{1e3 * med['chain']:>9.1f} {1e3 * med['per_path']:>9.1f} {rec['tree_over_chain']:>10.3f} "
                        f"{rec['per_path_over_tree']:>9.2f} {mem['tree'] / 2**20:>8.1f} {mem['chain'] / 2**20:>8.1f} "
                        f"{rec['kv_read_bytes'] / 2**20:>8.1f} {1e3 * floor.seconds:>9.3f} {rec['tree_over_floor']:>10.0f}")
                lines.append(((ctx, n, shape), line))
                print(line if len(lines) > 1 else header + "\n" + line, file=sys.stderr, flush=True)
            engine.release(req)
            del req
            gc.collect()
        del engine
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    lines = [line for _, line in sorted(lines)]
    print(f"machine: {machine}; {dtype}; medians of {reps} interleaved repetitions; "
          "R = rows over all root-to-leaf paths / N; MB = peak memory above the committed state during one call; "
          "read_MB = the KV bytes the tree step's kernels must read; floor = H200 roofline of the tree step "
          "(both benchmarks/roofline.py); each N runs on its own engine (num_draft_tokens = N)")
    print(header)
    print("\n".join(lines))
    if args.plot:
        print(plot(records, args.plot))
    trees = [r for r in records if r["shape"] == "topk4" and r["N"] == 8] or [r for r in records if r["shape"] == "topk4"]
    head = min(trees, key=lambda r: abs(r["context"] - 65536))
    summary = {k: head[k] for k in ("tree_over_chain", "per_path_over_tree", "path_rows_over_n", "leaves",
                                    "extra_mem_frac", "context", "N", "kv_read_bytes", "floor_s", "tree_over_floor")}
    summary.update(machine=machine, dtype=str(dtype), kv_cache_dtype=args.kv_cache_dtype, backend=args.backend, records=records)
    print(json.dumps(summary))


def plot(records, path) -> str:
    """Write the PNG; returns the one-line note to print (plotting is optional)."""
    try:
        import matplotlib
    except ImportError:
        return f"plot: skipped, matplotlib is not installed (pip install 'dsv4-tree[bench]'); {path} not written"

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    trees = [r for r in records if r["shape"] == "topk4"]
    for n in sorted({r["N"] for r in trees}):
        rs = sorted((r for r in trees if r["N"] == n), key=lambda r: r["context"])
        a.plot([r["context"] for r in rs], [1e3 * r["tree_s"] for r in rs], marker="o", label=f"tree N={n}")
    a.set_xscale("log", base=2)
    a.set_xlabel("context (tokens)")
    a.set_ylabel("verify time (ms)")
    a.legend(fontsize=7)
    ctx = max(r["context"] for r in trees)
    rs = sorted((r for r in trees if r["context"] == ctx), key=lambda r: r["N"])
    for key, label in (("tree_s", "tree"), ("chain_s", "chain (same rows)"), ("per_path_s", "per-path")):
        b.plot([r["N"] for r in rs], [1e3 * r[key] for r in rs], marker="o", label=label)
    b.set_xlabel(f"nodes N (context {ctx})")
    b.set_ylabel("verify time (ms)")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"plot: {path}"


if __name__ == "__main__":
    main()
