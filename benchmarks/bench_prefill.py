"""Prefill throughput: prompt tokens per second at 2K and 16K prompt lengths, and the share of
the time spent on host bookkeeping (building each chunk's chain tree and verify plan).

A prefill runs the prompt in chunks of prefill_chunk tokens, each verified as a chain and
committed; chain construction must stay linear in the chunk length so long prompts are not
dominated by bookkeeping. Human table first, one JSON line last."""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import torch

import dsv4_tree as dt
from dsv4_tree.checkpoint.tiny import random_model
from dsv4_tree.tree.draft_tree import DraftTree


class Timed:
    """Wraps a function and accumulates the wall time spent inside it."""

    def __init__(self, fn):
        self.fn, self.seconds = fn, 0.0

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0


def run(model, length: int, chunk: int, seed: int) -> dict:
    engine = dt.Engine(model, dt.SpecConfig(prefill_chunk=chunk, max_requests=1, max_total_tokens=length + chunk))
    ids = torch.randint(2, model.vocab_size, (length,), generator=torch.Generator().manual_seed(seed))
    chain, plan = Timed(DraftTree.chain.__func__), Timed(engine.runtime.plan)  # plan: page mapping + tables
    orig_chain = DraftTree.chain
    DraftTree.chain, engine.runtime.plan = classmethod(chain), plan
    try:
        t0 = time.perf_counter()
        req = engine.prefill(ids)
        total = time.perf_counter() - t0
    finally:
        DraftTree.chain = orig_chain
    assert req.seq_len == length - 1
    return {"prompt": length, "chunk": chunk, "seconds": total, "tokens_per_s": (length - 1) / total,
            "chain_s": chain.seconds, "plan_s": plan.seconds, "bookkeeping_frac": (chain.seconds + plan.seconds) / total}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--lengths", default="2048,16384", help="comma list of prompt lengths")
    ap.add_argument("--chunks", default="256,2048", help="comma list of prefill_chunk values")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    chunks = [int(x) for x in args.chunks.split(",")]
    model = dt.load_model(random_model(dt.tiny_config(max_position_embeddings=max(lengths) + 64), seed=args.seed))
    machine = f"{platform.machine()} CPU, {torch.get_num_threads()} threads"
    header = f"{'prompt':>7} {'chunk':>6} {'seconds':>8} {'tok/s':>9} {'chain_ms':>9} {'plan_ms':>8} {'bookkeeping':>11}"
    print(f"machine: {machine}; torch {torch.__version__}; tiny model (4 layers: SWA, C4 + indexer, C128)",
          file=sys.stderr)
    records, lines = [], []
    for length in lengths:
        for chunk in chunks:
            rec = run(model, length, chunk, args.seed)
            records.append(rec)
            lines.append(f"{length:>7} {chunk:>6} {rec['seconds']:>8.2f} {rec['tokens_per_s']:>9.0f} "
                         f"{1e3 * rec['chain_s']:>9.2f} {1e3 * rec['plan_s']:>8.1f} {rec['bookkeeping_frac']:>10.1%}")
            print(lines[-1], file=sys.stderr, flush=True)
    print(f"machine: {machine}; one prefill per row; chain_ms: DraftTree.chain, plan_ms: the verify plan (page mapping + tables) "
          "(both host bookkeeping); bookkeeping = their share of the prefill time")
    print(header)
    print("\n".join(lines))
    print(json.dumps({"bench": "prefill", "machine": machine, "records": records}))


if __name__ == "__main__":
    main()
