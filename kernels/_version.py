"""The Triton version the kernels run under, read once, and what depends on it.

GPU users bring their own torch, and each CUDA torch wheel pins its Triton (torch 2.11: 3.6.0,
2.13: 3.7.1, 2.14: 3.8.x; design_notes/triton-versions.md). Where a kernel, its interpreter form
or the ahead-of-time gate needs a different form under one of those versions, it reads the
version here (one place), and the place that branches says why."""
from __future__ import annotations

import triton


def _parse(version: str) -> tuple:
    """'3.8.0' / '3.9.0+git1234' -> (3, 8)."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


TRITON = _parse(triton.__version__)  # (major, minor)

# Launch choices that differ by version, each found by the sm_90a gate (dsv4_tree/aot) compiling
# the library's launches under that version's compiler and ptxas:
#
# * Sparse decode at head_dim 512 runs 2 pipeline stages; 3.6 spills 28 bytes there with one list
#   (no extra entries) and is clean with 1 stage (with two lists, 2 stages are clean and 1 spills).
#   (3.6 also spilled the grouped form at head_dim 512, 420-524 bytes, until the record layout's
#   constants became constexprs and the logits were computed keys first, for every version:
#   kernels/sparse_decode.py.)


def wide_decode_stages(has_extra: bool) -> int:
    """Pipeline stages of sparse decode at head_dim > 256."""
    return 1 if TRITON < (3, 7) and not has_extra else 2


# * The indexer's key tile at rows of 8 or fewer: 64 columns, but 3.7 spills at KP 1024 (V4-Flash's
#   top 512) and 3.6 at KP 2048 (V4-Pro's top 1024, 32 bytes) with 64; both are clean with 32.
INDEXER_WIDE_TILE = 32 if TRITON < (3, 8) else 64
# * The compressor's row block at head_dim 512: 16 rows, but 3.6 spills 196 bytes there; 8 rows
#   are clean.
COMPRESS_ROWS = 8 if TRITON < (3, 7) else 16
# * The table build's rows per program: 16, but 3.6 spills 8-56 bytes there at V4-Flash's tables
#   (C4 ancestor walks of 1-64 blocks, 254-255 registers); 8 rows take 162-168 registers, clean.
TABLE_ROWS = 8 if TRITON < (3, 7) else 16
