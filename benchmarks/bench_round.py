"""What one generate_batch round costs the host, and the MTP topk-2-tree protocol of arXiv 2609.24698.

Part 1, per round (the rounds that ran every request of the batch), at bs 1 and 16, one torch
thread, fp32, on the shipped checkpoint: host reads (diagnostics.HostReadCounter: what a GPU
would wait for), non-view aten ops, and draft ms, for the MTP tree (topk 4, 5 steps, 8 nodes),
the DSpark chain (fixed) and the budgeted DSpark tree (topk 4, 16 nodes; a cost table measured
here first with profile_costs), greedy, and the two DSpark cases sampled (temperature 1: drawn
chain and drawn tree). The targets are ratios of bs 16 to bs 1 measured in this run.

Part 2, the paper's protocol: MTP trees at topk 2 against topk-1 chains at equal depth D (5..8),
greedy, on prompts outside the checkpoint's training corpus (this project's own sources): tokens
per verify and tokens/s, each case its fastest of --reps interleaved runs. The tree has the CLI's
node count for topk 2 (drafters/base.default_tree_nodes), the chain D + 1 nodes.

Prints a table per part and, as the last line, one JSON object with every record."""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import torch

import dsv4_tree as dt
import dsv4_tree.generate_batch as gb
from dsv4_tree.diagnostics import HostReadCounter, OpCounter
from dsv4_tree.drafters.base import TreeShape, default_tree_nodes
from dsv4_tree.budget.cost_profile import profile_costs
from dsv4_tree.drafters.dspark import DSparkDrafter
from dsv4_tree.train.corpus import heldout_prompt

sys.path.insert(0, __import__("os").path.dirname(__file__))
from bench_budget import project_prompt  # noqa: E402

NON_VIEW = ("aten.view", "aten._unsafe_view", "aten.slice", "aten.select", "aten.unsqueeze", "aten.squeeze",
            "aten.expand", "aten.permute", "aten.transpose", "aten.t", "aten.alias", "aten.detach", "aten.as_strided",
            "aten.reshape", "aten._reshape_alias", "aten.split", "aten.unbind", "aten.narrow")


def round_cases(gamma: int) -> dict:
    """case -> (drafter, topk, steps, nodes, draft_depth, temperature: None greedy, else sampled)."""
    return {"mtp tree": ("mtp", 4, 5, 8, "fixed", None), "dspark chain": ("dspark", 1, gamma, gamma + 1, "fixed", None),
            "dspark tree budgeted": ("dspark", 4, gamma, 16, "adaptive", None),
            "dspark chain sampled": ("dspark", 1, gamma, gamma + 1, "fixed", 1.0),
            "dspark tree sampled": ("dspark", 4, gamma, 16, "adaptive", 1.0)}


def measure_rounds(model, case, spec_args, bs: int, prompts, new_tokens: int, table) -> dict:
    kind, topk, steps, nodes, depth, temperature = spec_args
    spec = dt.SpecConfig(eagle_topk=topk, num_steps=steps, num_draft_tokens=nodes, draft_depth=depth, max_requests=16,
                         accept="greedy" if temperature is None else "sampling")
    engine = dt.Engine(model, spec)
    drafter = "mtp" if kind == "mtp" else DSparkDrafter(model, TreeShape.from_spec(spec), cost_table=table)
    run = dict(drafter=drafter, progress=False, temperature=temperature)
    seed = lambda: None if temperature is None else torch.Generator().manual_seed(0)  # noqa: E731
    engine.generate_batch(prompts[:bs], 4, generator=seed(), **run)  # warm-up
    seen, real = [], gb._round

    def counted(engine, live, *args):
        with HostReadCounter() as reads, OpCounter() as ops:
            out = real(engine, live, *args)
        if len(live) == bs:
            seen.append((reads.total, sum(n for name, n in ops.by_name.items() if name not in NON_VIEW)))
        return out

    gb._round = counted
    try:
        engine.generate_batch(prompts[:bs], new_tokens, generator=seed(), **run)
    finally:
        gb._round = real
    # timed on its own (the counters intercept every op): the draft ms of the rounds with all bs live
    outs = engine.generate_batch(prompts[:bs], new_tokens, generator=seed(), **run)
    longest = min(outs, key=lambda o: o.stats.rounds).stats  # every one of its rounds had the whole batch
    draft = longest.round_draft_seconds
    return {"case": case, "bs": bs, "rounds": len(seen), "host_reads_per_round": max(r for r, _ in seen),
            "host_reads_min": min(r for r, _ in seen), "ops_per_round": sum(o for _, o in seen) / len(seen),
            "draft_ms_per_round": 1e3 * sorted(draft)[len(draft) // 2]}


def paper_case(model, topk: int, depth: int, bs: int, prompts, new_tokens: int) -> tuple:
    nodes = depth + 1 if topk == 1 else default_tree_nodes(topk, depth)
    spec = dt.SpecConfig(eagle_topk=topk, num_steps=depth, num_draft_tokens=nodes, draft_depth="fixed", max_requests=bs)
    return dt.Engine(model, spec), nodes


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--prompt-len", type=int, default=96)
    ap.add_argument("--depths", default="5,6,7,8", help="part 2's depths D")
    ap.add_argument("--paper-bs", default="1,4", help="part 2's batch sizes")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--skip-paper", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model = dt.load_model(dt.trained_checkpoint())
    from dsv4_tree.checkpoint.dspark_names import load_dspark

    gamma = load_dspark(model).block_size
    prompts = [project_prompt(args.prompt_len, s) for s in range(16)]
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, 1 thread", flush=True)
    prof_spec = dt.SpecConfig(eagle_topk=4, num_steps=gamma, num_draft_tokens=16, draft_depth="adaptive", max_requests=16)
    prof_engine = dt.Engine(model, prof_spec)
    prof = DSparkDrafter(model, TreeShape.from_spec(prof_spec), size="adaptive")
    prof.policy.forced_nodes = gamma + 1
    t0 = time.perf_counter()
    table = profile_costs(prof_engine, prof, [heldout_prompt(args.prompt_len, 400 + s) for s in range(16)],
                          batch_sizes=[1, 16], rounds=3)
    print(f"[profile] {table} ({time.perf_counter() - t0:.1f}s)", file=sys.stderr)
    records = []
    print("case                   bs  rounds  host reads  ops/round  draft ms/round")
    for case, spec_args in round_cases(gamma).items():
        for bs in (1, 16):
            r = measure_rounds(model, case, spec_args, bs, prompts, args.new_tokens, table)
            records.append(r)
            print(f"{case:22s} {bs:3d} {r['rounds']:7d} {r['host_reads_min']:5d}-{r['host_reads_per_round']:<5d}"
                  f" {r['ops_per_round']:10.0f} {r['draft_ms_per_round']:14.2f}", flush=True)
    ratios = []
    for case in round_cases(gamma):
        one, many = (next(r for r in records if r["case"] == case and r["bs"] == bs) for bs in (1, 16))
        ratios.append({"case": case, "ops_bs16_over_bs1": many["ops_per_round"] / one["ops_per_round"],
                       "draft_ms_bs16_over_bs1": many["draft_ms_per_round"] / one["draft_ms_per_round"],
                       "host_reads_bs1": one["host_reads_per_round"], "host_reads_bs16": many["host_reads_per_round"]})
        print(f"{case:22s} ops x{ratios[-1]['ops_bs16_over_bs1']:.2f} (target <= 1.25), "
              f"draft ms x{ratios[-1]['draft_ms_bs16_over_bs1']:.2f} (target <= 2), "
              f"host reads {one['host_reads_per_round']} / {many['host_reads_per_round']} (target <= 4, equal)")
    paper = []
    if not args.skip_paper:
        print("\nMTP topk 2 tree vs topk 1 chain at equal depth (project prompts, greedy)")
        print(" D  bs  chain tok/verify  tree tok/verify  AL ratio  chain tok/s  tree tok/s  tok/s ratio  tree nodes")
        for bs in (int(x) for x in args.paper_bs.split(",")):
            for depth in (int(x) for x in args.depths.split(",")):
                engines = {k: paper_case(model, k, depth, bs, prompts, args.new_tokens) for k in (1, 2)}
                best = {}
                for _ in range(args.reps):
                    for k, (eng, nodes) in engines.items():
                        t0 = time.perf_counter()
                        outs = eng.generate_batch(prompts[:bs], args.new_tokens, drafter="mtp", progress=False)
                        secs = time.perf_counter() - t0
                        acc = [a for o in outs for a in o.stats.accept_lengths]
                        tok = sum(len(o.tokens) for o in outs)
                        if k not in best or tok / secs > best[k]["tokens_per_s"]:
                            best[k] = {"tokens_per_s": tok / secs, "tokens_per_verify": sum(acc) / len(acc), "nodes": nodes}
                c, t = best[1], best[2]
                paper.append({"depth": depth, "bs": bs, "chain": c, "tree": t})
                print(f"{depth:2d} {bs:3d} {c['tokens_per_verify']:17.3f} {t['tokens_per_verify']:16.3f} "
                      f"{t['tokens_per_verify'] / c['tokens_per_verify']:9.3f} {c['tokens_per_s']:12.1f} "
                      f"{t['tokens_per_s']:11.1f} {t['tokens_per_s'] / c['tokens_per_s']:12.3f} {t['nodes']:11d}",
                      flush=True)
    print(json.dumps({"rounds": records, "ratios": ratios, "paper_protocol": paper, "torch": torch.__version__,
                      "machine": platform.machine()}))


if __name__ == "__main__":
    main()
