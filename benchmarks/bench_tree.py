"""How long do the SGLang-compatible tree tensors take? (organize_draft_results + build_tree +
verify_tree_greedy, batched, on this machine's CPU). Human table first, one JSON line last."""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from dsv4_tree.tree import TreeMaskMode, build_tree, organize_draft_results, verify_tree_greedy
from dsv4_tree.tree.simulate import simulated_eagle_draft


def median_ms(fn, reps):
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - t))
    return statistics.median(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="fewer cases and repetitions")
    args = ap.parse_args(argv)
    torch.set_num_threads(torch.get_num_threads())
    bss = (1, 8, 64) if args.quick else (1, 4, 16, 64)
    ns = (8, 64) if args.quick else (8, 16, 32, 64)
    reps = 5 if args.quick else args.reps
    k, steps = 8, 8  # pool = 8 + 7*64 = 456 candidates
    records = []
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"{'bs':>4} {'N':>4} {'organize_ms':>11} {'build_ms':>9} {'greedy_ms':>9} {'total_ms':>9}")
    for bs in bss:
        for n in ns:
            s, t, p = simulated_eagle_draft(bs, k, steps)
            org = organize_draft_results(s, t, p, n)
            seq = torch.full((bs,), 1000)
            bonus = torch.zeros(bs, dtype=torch.long)
            built = build_tree(bonus, org.parent_list, org.top_scores_index, org.draft_tokens, seq, k, steps, n,
                               TreeMaskMode.QLEN_ONLY)
            target = built.draft_tokens.clone()
            o = median_ms(lambda: organize_draft_results(s, t, p, n), reps)
            b = median_ms(lambda: build_tree(bonus, org.parent_list, org.top_scores_index, org.draft_tokens, seq,
                                             k, steps, n, TreeMaskMode.QLEN_ONLY), reps)
            g = median_ms(lambda: verify_tree_greedy(built.draft_tokens.view(bs, n), built.retrieve_index,
                                                     built.retrieve_next_token, built.retrieve_next_sibling,
                                                     target, steps + 1), reps)
            records.append({"bs": bs, "N": n, "organize_ms": o, "build_ms": b, "greedy_ms": g})
            print(f"{bs:>4} {n:>4} {o:>11.3f} {b:>9.3f} {g:>9.3f} {o + b + g:>9.3f}")
    print(json.dumps({"bench": "tree_tensors", "topk": k, "num_steps": steps, "records": records}))


if __name__ == "__main__":
    main()
