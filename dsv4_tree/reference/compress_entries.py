"""Reference of a compressor's fused entry writer (kernels/compress_entries.py), row by row.

For every verify row t: gather its block's R source rows by slot from the compressor's row pools
(a slot < 0 is the null row before position 0: kv 0, gate -inf; with C4's overlap, R = 2m: rows
r < m give the previous block's first head_dim channels, rows r >= m this block's last ones),
add the module's position bias, then `ref_pool_entries` (fp32 softmax pooling, kv_norm, RoPE at
the block start through numerics/rope.py's full-width tables, as the torch path applies them).
The entries go to slots ct.entry_out through the torch writer (`KVPool.write` of a pool without
kernels: serving/records.py's quantize_rows and the byte scatter for FP8 pools)."""
from __future__ import annotations

import torch

from ..numerics.rope import apply_rope, rope_pairs, rope_tables
from .ops import ref_pool_entries


def ref_block_rows(rows_kv: torch.Tensor, rows_gate: torch.Tensor, src: torch.Tensor, bias: torch.Tensor,
                   ratio: int, overlap: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """rows_kv, rows_gate [S, W]; src [T, R] slots (-1 = null row); bias [m, W] ->
    kv, gate [T, R, d] (gate with the bias added, -inf on null rows), d = W / 2 with overlap, else W."""
    d = rows_kv.shape[1] // 2 if overlap else rows_kv.shape[1]
    kv_rows, gate_rows = [], []
    for t in range(src.shape[0]):
        kv_t, gate_t = [], []
        for r, slot in enumerate(src[t].tolist()):
            first = d * (r // ratio) if overlap else 0  # overlap: block w-1's channels [0, d), then w's [d, 2d)
            cols = slice(first, first + d)
            g = rows_gate[max(slot, 0), cols] + bias[r % ratio, cols]
            if slot < 0:
                kv_t.append(torch.zeros_like(rows_kv[0, cols]))
                gate_t.append(torch.full_like(g, float("-inf")))
            else:
                kv_t.append(rows_kv[slot, cols])
                gate_t.append(g)
        kv_rows.append(torch.stack(kv_t))
        gate_rows.append(torch.stack(gate_t))
    return torch.stack(kv_rows), torch.stack(gate_rows)


def ref_compress_entries(pool, ct, module, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """pool: CompressorPools; ct: CompressTables of its ratio (src [T, R]); module: the compressor
    (position_bias, kv_norm); cos, sin [T, half]: rotary angles at each row's block start.
    Returns the entries [T, head_dim] in the model dtype (what the kernel stores at ct.entry_out)."""
    kv, gate = ref_block_rows(pool.rows_kv, pool.rows_gate, ct.src, module.position_bias.detach(), ct.ratio,
                              pool.overlap)
    c, s = rope_pairs(cos.unsqueeze(0), sin.unsqueeze(0))
    full_c, full_s = rope_tables(c, s, pool.head_dim)
    return ref_pool_entries(kv, gate, module.kv_norm, full_c, full_s, apply_rope)
