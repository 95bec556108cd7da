"""Acceptance on the shipped trained checkpoint: greedy, held-out stdlib prompts. For each
drafter/shape: mean tokens per verify (accepted drafts + bonus) and tokens per second
(wall time of whole rounds: draft + verify + accept + commit). Human table first, one JSON
line last."""
from __future__ import annotations

import argparse
import json
import platform
import time

import torch

import dsv4_tree as dt
from dsv4_tree.drafters import MtpDrafter, NgramDrafter, TreeShape
from dsv4_tree.train.corpus import heldout_prompt

CASES = [
    # label, drafter, topk, num_steps, num_draft_tokens
    ("no speculation", "none", 1, 1, 1),
    ("chain MTP N=4", "mtp", 1, 3, 4),
    ("tree MTP N=8 topk 2", "mtp", 2, 4, 8),
    ("tree MTP N=8 topk 4", "mtp", 4, 3, 8),
    ("tree MTP N=16 topk 4", "mtp", 4, 4, 16),
    ("n-gram chain N=4", "ngram", 1, 3, 4),
    ("n-gram tree N=8 topk 4", "ngram", 4, 3, 8),
]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prompts", type=int, default=4, help="held-out prompts")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=96)
    args = ap.parse_args(argv)
    model = dt.load_model(dt.trained_checkpoint())
    prompts = [heldout_prompt(args.prompt_len, seed) for seed in range(args.prompts)]
    rows = []
    print(f"machine: {platform.machine()} CPU, {torch.get_num_threads()} threads; torch {torch.__version__}; fp32; "
          f"{args.prompts} held-out prompts x {args.new_tokens} new bytes, greedy")
    print(f"{'case':<24} {'tokens/verify':>13} {'tokens/s':>9} {'verifies':>8}")
    reference = None
    for label, kind, topk, steps, nodes in CASES:
        spec = dt.SpecConfig(eagle_topk=topk, num_steps=steps, num_draft_tokens=nodes)
        eng = dt.Engine(model, spec)
        shape = TreeShape(topk, steps, nodes)
        total_tokens = total_rounds = 0
        outs = []
        t0 = time.perf_counter()
        for p in prompts:
            if kind == "none":
                drafter = _NoDraft()
            elif kind == "mtp":
                drafter = MtpDrafter(model, shape)
            else:
                drafter = NgramDrafter(shape)
            res = eng.generate(p, args.new_tokens, drafter=drafter, progress=False)
            outs.append(res.tokens)
            total_tokens += len(res.tokens)
            total_rounds += res.stats.rounds
        secs = time.perf_counter() - t0
        if reference is None:
            reference = outs
        same = outs == reference
        rec = {"case": label, "tokens_per_verify": total_tokens / total_rounds, "tokens_per_s": total_tokens / secs,
               "verifies": total_rounds, "output_equals_no_speculation": same}
        rows.append(rec)
        print(f"{label:<24} {rec['tokens_per_verify']:>13.3f} {rec['tokens_per_s']:>9.1f} {total_rounds:>8}"
              + ("" if same else "  OUTPUT DIFFERS"))
    print(json.dumps({"bench": "accept", "records": rows}))


class _NoDraft:
    def draft(self, engine, requests):
        return [dt.DraftTree.chain([r.root_token]) for r in requests]


if __name__ == "__main__":
    main()
