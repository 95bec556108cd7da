"""Commit time against the sliding-window length W: commit moves the accepted path's records and
the entries it closed (slot copies), so its cost must not grow with W or with the context.

For each W, a tiny random DeepSeek-V4 (all layer types) with that window: prefill a prompt of
2 W tokens, then repeatedly verify an 8-node topk-4 tree and commit its deepest path; report
the median commit time and the slots moved per commit. Human table first, one JSON line last."""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

import dsv4_tree as dt
from dsv4_tree.checkpoint.tiny import random_model
from dsv4_tree.serving.commit import plan_moves
from dsv4_tree.tree.simulate import eagle_tree


def measure(window: int, rounds: int) -> dict:
    cfg = dt.tiny_config(sliding_window=window, max_position_embeddings=8 * window + 64)
    engine = dt.Engine(dt.load_model(random_model(cfg)),
                       dt.SpecConfig(eagle_topk=4, num_steps=4, num_draft_tokens=8, max_requests=1))
    req = engine.prefill(torch.randint(2, cfg.vocab_size, (2 * window,), generator=torch.Generator().manual_seed(0)))
    times, moved = [], []
    for r in range(rounds):
        tree = eagle_tree(req.root_token, 8, topk=4, seed=r, vocab=cfg.vocab_size)
        out = engine.verify([req], [tree])
        node = int(tree.depth.argmax())
        path = tree.path[node][tree.path[node] >= 0]
        acc = dt.Acceptance(tuple(path.tolist()), 3, req.request_id, out.verify_id)
        moves = plan_moves(engine.runtime.pages, engine.runtime.layout, [req.row], [req.seq_len], [path])
        moved.append(moves.recent_src.numel() + sum(v.numel() for v in moves.entry_src.values()))
        t = time.perf_counter()
        engine.commit([req], [acc], out)
        times.append(time.perf_counter() - t)
    return {"window": window, "commit_ms": 1e3 * statistics.median(times), "slots_moved": statistics.mean(moved),
            "context": req.seq_len}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--windows", default="32,128,512,2048")
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    records = [measure(int(w), args.rounds) for w in args.windows.split(",")]
    machine = f"{platform.machine()} CPU, 1 thread"
    print(f"machine: {machine}; torch {torch.__version__}; median commit of {args.rounds} rounds")
    print(f"{'W':>6} {'context':>8} {'commit_ms':>10} {'slots moved':>12}")
    for r in records:
        print(f"{r['window']:>6} {r['context']:>8} {r['commit_ms']:>10.3f} {r['slots_moved']:>12.1f}")
    base = records[0]["commit_ms"]
    print(f"commit time at the largest W / smallest W: {records[-1]['commit_ms'] / base:.2f}")
    print(json.dumps({"bench": "commit", "machine": machine, "records": records,
                      "largest_over_smallest": records[-1]["commit_ms"] / base}))


if __name__ == "__main__":
    main()
