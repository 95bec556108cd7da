"""Bytes per stored token of each KV storage dtype and record kind, measured on KVPool objects:
the record size (`bytes_per_token`) and the allocated bytes per slot including page padding
(`storage.nbytes / (num_pages * page_size)`), plus the round-trip error of Gaussian rows
(worst over rows of max|read - written| / max|written|, rows written in the compute dtype).
Human table first, one JSON line last."""
from __future__ import annotations

import argparse
import json

import torch

from dsv4_tree.serving import KVPool

# label, kind, head_dim, rope_dim (rope_dim plays no part in FP8 indexer keys)
SHAPES = [
    ("V4 K=V / entry", "kv", 512, 64),
    ("V4 indexer key", "index_key", 128, 64),
    ("tiny K=V / entry", "kv", 32, 8),
    ("tiny indexer key", "index_key", 16, 4),
]
DTYPES = [("auto (fp32)", "auto", torch.float32), ("auto (bf16)", "auto", torch.bfloat16),
          ("bfloat16", "bfloat16", torch.float32), ("fp8_e4m3", "fp8_e4m3", torch.float32)]


def measure(kind, head_dim, rope_dim, kv_dtype, compute_dtype, page_size, rows):
    pool = KVPool(page_size * 4, head_dim, rope_dim, kv_dtype, page_size, "cpu", compute_dtype, kind=kind)
    allocated = pool.storage.nbytes / (pool.num_pages * page_size)
    slots = torch.arange(rows.shape[0])
    written = rows.to(compute_dtype)
    pool.write(slots, written)
    back, want = pool.read(slots).float(), written.float()
    err = ((back - want).abs().amax(dim=1) / want.abs().amax(dim=1)).max().item()
    return pool.bytes_per_token, allocated, err


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=256, help="Gaussian rows for the error column")
    args = ap.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    results = []
    print("| record | dtype | bytes/token | allocated/token ps=256 | ps=16 | vs bf16 | worst row rel. error |")
    print("|---|---|---|---|---|---|---|")
    for label, kind, d, r in SHAPES:
        rows = torch.randn(min(args.rows, 64), d, generator=g)
        bf16 = 2 * d
        for dlabel, kv_dtype, cdtype in DTYPES:
            bpt, alloc256, err = measure(kind, d, r, kv_dtype, cdtype, 256, rows)
            _, alloc16, _ = measure(kind, d, r, kv_dtype, cdtype, 16, rows)
            print(f"| {label} ({d}/{r}) | {dlabel} | {bpt} | {alloc256:.2f} | {alloc16:.2f} | "
                  f"{bpt / bf16:.0%} | {err:.1e} |")
            results.append(dict(record=label, head_dim=d, rope_dim=r, dtype=dlabel, bytes_per_token=bpt,
                                allocated_ps256=alloc256, allocated_ps16=alloc16, rel_error=err))
    print(json.dumps({"bench": "kv_bytes", "results": results}))


if __name__ == "__main__":
    main()
