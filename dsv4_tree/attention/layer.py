"""One DeepSeek-V4 attention block over all verify rows of all requests, reading the pools
through the verify tables (one sparse-attention call per layer, whatever the batch).

Reuses the Hugging Face module's weights and helpers (projections, norms, RoPE); replaces how
the block reads its context: each row's window and compressed entries are index lists."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..numerics.norms import rms_norm
from ..numerics.rope import rope_tables
from .torch_ops import select_topk_table
from ..serving.pools import LayerPools
from ..serving.tables import VerifyPlan
from .compress import branch_entries


@dataclass(frozen=True)
class RowRope:
    """cos/sin computed once per verify: for rows ("main"/"compress") and block starts.
    `full` widens them to a head width (numerics/rope.py: rope_tables) once per verify."""

    rows: dict  # rope label -> RoPE pair tables (cos, sin) [1, T, rope_dim/2, 2] (numerics/rope.py)
    blocks: dict  # ratio -> the same [1, E, rope_dim/2, 2]; None where no row closes a block
    widened: dict = field(default_factory=dict)  # (label or ratio, width, inverse) -> full-width tables

    def full(self, key, width: int, inverse: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Full-width tables [1, 1, T (or E), width] of rows[key] (a label) or blocks[key] (a
        ratio); inverse: the inverse rope's (-sin)."""
        k = (key, width, inverse)
        if k not in self.widened:
            c, s = self.rows[key] if isinstance(key, str) else self.blocks[key]
            self.widened[k] = rope_tables(c, -s if inverse else s, width)
        return self.widened[k]


def kv_rows(attn, x, cos, sin, apply_rope) -> torch.Tensor:
    """The K=V rows (kv_norm, RoPE) a layer stores for inputs x [1, T, hidden]. -> [T, head_dim]"""
    t, d = x.shape[1], attn.head_dim
    kv = rms_norm(attn.kv_norm, attn.kv_proj(x)).view(1, t, 1, d).transpose(1, 2)
    return apply_rope(kv, cos, sin)[0, 0]


def _compressed(attn, x, q_res, plan: VerifyPlan, pools: LayerPools, rope: RowRope, ops, apply_rope):
    """Write this layer's compressor rows and branch entries; -> (extra index [T, K], lengths [T], ties)."""
    comp = attn.compressor
    ct = plan.compress[comp.compress_rate]
    closes = ct.closing.shape[0] > 0  # a host-known shape: most decode steps close no block
    pools.main.write_rows(plan.out_loc, comp.kv_proj(x)[0], comp.gate_proj(x)[0])
    if closes:
        cs = rope.full(comp.compress_rate, pools.main.head_dim)
        pools.main.entries.write(ct.entry_out, branch_entries(pools.main, ct, comp, cs, apply_rope, ops.pool_entries))
    idx = getattr(comp, "indexer", None)
    if idx is None:
        return ct.entries, ct.entry_len, None
    t = plan.num_rows
    pools.indexer.write_rows(plan.out_loc, idx.kv_proj(x)[0], idx.gate_proj(x)[0])
    if closes:
        cs = rope.full(comp.compress_rate, pools.indexer.head_dim)
        pools.indexer.entries.write(ct.entry_out, branch_entries(pools.indexer, ct, idx, cs, apply_rope,
                                                                 ops.pool_entries))
    ccos, csin = rope.full("compress", idx.head_dim)
    iq = idx.q_b_proj(q_res).view(1, t, idx.num_heads, idx.head_dim).transpose(1, 2)
    iq = apply_rope(iq, ccos, csin)[0].transpose(0, 1).contiguous()  # [T, HI, dI]
    iw = idx.scorer.weights_proj(x)[0].float() * idx.scorer.weights_scaling  # [T, HI]
    scores = ops.indexer_scores(iq, iw, pools.indexer.entries, ct.entries, idx.scorer.softmax_scale)
    return select_topk_table(scores, ct.entries, idx.index_topk)


def attention_rows(attn, x, plan: VerifyPlan, pools: LayerPools, rope: RowRope, ops, apply_rope):
    """x [1, T, hidden] -> (output [1, T, hidden], top-k boundary ties (tensor) or None).
    Writes the rows' K=V, compressor rows and branch entries into the pools first."""
    t = plan.num_rows
    h, d = attn.num_heads, attn.head_dim
    cos, sin = rope.full(attn.rope_layer_type, d)
    q_res = rms_norm(attn.q_a_norm, attn.q_a_proj(x))
    q = rms_norm(attn.q_b_norm, attn.q_b_proj(q_res).view(1, t, h, d).transpose(1, 2))
    q = apply_rope(q, cos, sin)[0].transpose(0, 1).contiguous()  # [T, H, d]
    pools.swa.write(plan.out_loc, kv_rows(attn, x, cos, sin, apply_rope))
    extra = extra_index = extra_len = ties = None
    if attn.compressor is not None:
        extra_index, extra_len, ties = _compressed(attn, x, q_res, plan, pools, rope, ops, apply_rope)
        extra = pools.main.entries
    out, _ = ops.sparse_decode(q, pools.swa, plan.swa_index, plan.swa_len, attn.sinks, attn.scaling,
                               extra, extra_index, extra_len)
    inv_cos, inv_sin = rope.full(attn.rope_layer_type, d, inverse=True)
    out = apply_rope(out.unsqueeze(0).transpose(1, 2), inv_cos, inv_sin).transpose(1, 2)
    grouped = attn.o_a_proj(out.reshape(1, t, attn.config.o_groups, -1)).flatten(2)
    return attn.o_b_proj(grouped), ties
