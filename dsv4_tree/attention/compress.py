"""Branch compressed entries: pool each closing row's block from the compressor's row pool.

`write_compressor` is the torch backend's AttentionOps.compressor_write: the rows into the row
pools, then every row's entry into the entry pool (the Triton backend does the same in two
launches: kernels/compress_entries.py)."""
from __future__ import annotations

import torch

from ..numerics.rope import apply_rope
from ..serving.pools import CompressorPools
from ..serving.tables import CompressTables
from . import torch_ops


def gather_block_rows(pool: CompressorPools, ct: CompressTables, bias: torch.Tensor):
    """Source rows of every row's entry, position bias added. -> kv, gate [T, R, head_dim]
    (R = m for C128; 2m for C4: block w-1's first-half channels, then block w's second half).
    Rows before position 0 (block -1) are null: kv 0, gate -inf."""
    ok = (ct.src >= 0).unsqueeze(-1)
    src = ct.src.clamp(min=0)
    kv = pool.rows_kv[src].masked_fill(~ok, 0.0)
    gate = pool.rows_gate[src].masked_fill(~ok, float("-inf"))
    if not pool.overlap:
        return kv, gate + bias
    m, d = ct.ratio, pool.head_dim
    prev_kv, prev_gate = kv[:, :m, :d], gate[:, :m, :d] + bias[:, :d]
    cur_kv, cur_gate = kv[:, m:, d:], gate[:, m:, d:] + bias[:, d:]
    return torch.cat([prev_kv, cur_kv], dim=1), torch.cat([prev_gate, cur_gate], dim=1)


def branch_entries(pool: CompressorPools, ct: CompressTables, module, rope_cs, apply_rope, pool_fn) -> torch.Tensor:
    """Entries closed inside this verify, one per row (rows that close no block pool the trash
    rows; their entry goes to the trash entry slot). [T, head_dim]"""
    kv, gate = gather_block_rows(pool, ct, module.position_bias)
    cos, sin = rope_cs
    return pool_fn(kv, gate, module.kv_norm, cos, sin, apply_rope)


def write_compressor(pool: CompressorPools, ct: CompressTables, module, slots: torch.Tensor, kv: torch.Tensor,
                     gate: torch.Tensor, rope) -> None:
    """One compressor's step: its rows kv, gate [T, W] at slots [T], then every row's entry
    (pooled from the rows just written, RoPE at the block start from rope.full) at ct.entry_out."""
    pool.write_rows(slots, kv, gate)
    cs = rope.full(ct.ratio, pool.head_dim)
    pool.entries.write(ct.entry_out, branch_entries(pool, ct, module, cs, apply_rope, torch_ops.pool_entries))
