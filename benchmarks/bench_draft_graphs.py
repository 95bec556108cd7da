"""Drafts eager against their captured replay (drafters/dspark_graphs.py, drafters/mtp_wave.py),
per batch size.

On the shipped checkpoint, greedy drafts: DSpark's fixed chain (gamma + 1 nodes), its budgeted
chain (SGLang's confidence-scheduled lengths, priced by PRICES below), fixed Markov
tree (topk 4, gamma steps, 8 nodes) and budgeted tree (topk 4, at most 16 nodes, priced by a
fixed cost table, PRICES, so both runs buy alike), and the MTP block's fixed-depth tree (topk 4,
5 steps, 8 nodes; its steps after the root are what is captured); sampled (temperature 1, the
same generator seed in both runs): DSpark's drawn tree under the chain budget (topk 4, at most
16 nodes, PRICES); generate_batch over held-out prompts at each batch
size, twice per repetition: the drafter eager (graphs=False) and captured (graphs=True on CUDA:
one CUDA graph per batch bucket; on CPU, --device cpu, executor/graphs.py's eager stand-in, which
rehearses the path and measures nothing of a graph). Reported per case and batch size: draft ms
per round (the longest request's rounds; a round's draft ends with its one host read, so the
time includes the device's work), tokens/s, and whether both runs generated the same tokens
(they must: the bucket's padding requests never touch a real row). Each number is the fastest
of --reps interleaved repetitions, after one warm-up run per case (the captures happen there).
Human table, then one JSON line."""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import torch

import dsv4_tree as dt
from dsv4_tree.checkpoint.dspark_names import load_dspark
from dsv4_tree.drafters.base import TreeShape
from dsv4_tree.budget.cost_table import LineTable
from dsv4_tree.drafters.dspark import DSparkDrafter
from dsv4_tree.drafters.mtp import MtpDrafter
from dsv4_tree.executor.graphs import eager_capture
from dsv4_tree.train.corpus import heldout_prompt


# a fixed price list for the budgeted tree (seconds = base + per node x nodes, by batch size):
# the same budget rule eager and captured; what it buys changes the verify, not the draft
PRICES = LineTable((1, 16), (0.01, 0.012), (0.0004, 0.0003), note="bench_draft_graphs' fixed price list")


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", help="the model's dtype (float32, bfloat16)")
    ap.add_argument("--bs", default="1,16", help="comma list of batch sizes")
    ap.add_argument("--new-tokens", type=int, default=32, help="tokens generated per request")
    ap.add_argument("--reps", type=int, default=3, help="interleaved repetitions; each run keeps its fastest")
    args = ap.parse_args(argv)
    bss = [int(x) for x in args.bs.split(",")]
    dtype = getattr(torch, args.dtype)
    model = dt.load_model(dt.trained_checkpoint(), device=args.device, dtype=dtype)
    gamma = load_dspark(model).block_size
    shapes = {"dspark chain": (TreeShape(1, gamma, gamma + 1), "fixed"),
              "dspark chain budgeted": (TreeShape(1, gamma, gamma + 1), "adaptive"),
              "dspark tree (topk 4, 8 nodes)": (TreeShape(4, gamma, 8), "fixed"),
              "dspark tree budgeted (<= 16 nodes)": (TreeShape(4, gamma, 16), "adaptive"),
              "dspark drawn tree budgeted (sampled)": (TreeShape(4, gamma, 16), "adaptive"),
              "mtp tree (topk 4, 8 nodes)": (TreeShape(4, 5, 8), "fixed")}
    sampled = {"dspark drawn tree budgeted (sampled)"}  # temperature 1, the same generator seed in both runs
    captured = True if args.device == "cuda" else eager_capture
    runs = {}
    for label, (shape, depth) in shapes.items():
        spec = dt.SpecConfig(eagle_topk=shape.topk, num_steps=shape.num_steps, num_draft_tokens=shape.num_draft_tokens,
                             draft_depth=depth, max_requests=max(bss), accept="sampling" if label in sampled else "greedy")
        for mode, graphs in (("eager", False), ("captured", captured)):
            engine = dt.Engine(model, spec)
            drafter = (MtpDrafter(model, shape, graphs=graphs) if label.startswith("mtp") else
                       DSparkDrafter(model, shape, graphs=graphs, cost_table=PRICES if depth == "adaptive" else None))
            runs[label, mode] = (engine, drafter)
    prompts = [heldout_prompt(96, s) for s in range(max(bss))]
    warm = [heldout_prompt(96, 300 + s) for s in range(max(bss))]

    def sampling(label: str, seed: int) -> dict:
        if label not in sampled:
            return {}
        return {"temperature": 1.0, "generator": torch.Generator(device=args.device).manual_seed(seed)}

    for (label, mode), (engine, drafter) in runs.items():
        for bs in bss:  # captures every bucket this run will replay
            engine.generate_batch(warm[:bs], 4, drafter=drafter, progress=False, **sampling(label, 0))
    best, outputs = {}, {}
    t_start = time.perf_counter()
    for rep in range(args.reps):
        for bs in bss:
            for (label, mode), (engine, drafter) in runs.items():
                _sync(args.device)
                t0 = time.perf_counter()
                outs = engine.generate_batch(prompts[:bs], args.new_tokens, drafter=drafter, progress=False,
                                             **sampling(label, bs))
                _sync(args.device)
                secs = time.perf_counter() - t0
                longest = max(outs, key=lambda o: o.stats.rounds).stats
                draft_ms = 1e3 * sum(longest.round_draft_seconds) / max(1, len(longest.round_draft_seconds))
                key = (label, mode, bs)
                outputs[key] = [o.tokens for o in outs]
                if key not in best or secs < best[key]["seconds"]:
                    best[key] = {"case": label, "mode": mode, "bs": bs, "seconds": secs, "rounds": longest.rounds,
                                 "draft_ms_per_round": draft_ms,
                                 "tokens_per_s": sum(len(o.tokens) for o in outs) / secs}
        print(f"[rep {rep}] done at {time.perf_counter() - t_start:.0f}s", file=sys.stderr, flush=True)
    machine = torch.cuda.get_device_name() if args.device == "cuda" else f"{platform.machine()} CPU"
    print(f"machine: {machine}; torch {torch.__version__}; {args.dtype}; shipped checkpoint, DSpark gamma {gamma}; "
          f"captured = {'CUDA graphs' if args.device == 'cuda' else 'the eager stand-in (no graph on CPU)'}")
    print(f"{'case':<36} {'bs':>3} {'eager draft ms':>14} {'captured draft ms':>17} {'eager/captured':>14} "
          f"{'tok/s eager':>11} {'tok/s captured':>14} {'same tokens':>11}")
    ratios = []
    for label in shapes:
        for bs in bss:
            e, c = best[label, "eager", bs], best[label, "captured", bs]
            same = outputs[label, "eager", bs] == outputs[label, "captured", bs]
            r = {"case": label, "bs": bs, "eager_draft_ms": e["draft_ms_per_round"],
                 "captured_draft_ms": c["draft_ms_per_round"],
                 "draft_eager_over_captured": e["draft_ms_per_round"] / c["draft_ms_per_round"],
                 "tokens_per_s_captured_over_eager": c["tokens_per_s"] / e["tokens_per_s"], "same_tokens": same}
            ratios.append(r)
            print(f"{label:<36} {bs:>3} {r['eager_draft_ms']:>14.2f} {r['captured_draft_ms']:>17.2f} "
                  f"{r['draft_eager_over_captured']:>14.2f} {e['tokens_per_s']:>11.1f} {c['tokens_per_s']:>14.1f} "
                  f"{'yes' if same else 'NO':>11}")
    print(json.dumps({"machine": machine, "torch": torch.__version__, "dtype": args.dtype, "device": args.device,
                      "gamma": gamma, "reps": args.reps, "ratios": ratios, "records": list(best.values())}))
    return 0 if all(r["same_tokens"] for r in ratios) else 1


if __name__ == "__main__":
    sys.exit(main())
