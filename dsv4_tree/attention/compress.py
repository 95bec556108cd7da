"""Branch compressed entries: pool each closing row's block from the compressor's row pool."""
from __future__ import annotations

import torch

from ..serving.pools import CompressorPools
from ..serving.tables import CompressTables


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
