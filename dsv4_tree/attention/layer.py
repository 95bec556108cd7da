"""One DeepSeek-V4 attention block over all verify rows of all requests, reading the pools
through the verify tables (one sparse-attention call per layer, whatever the batch).

Reuses the Hugging Face module's weights and helpers (projections, norms, RoPE); replaces how
the block reads its context: each row's window and compressed entries are index lists."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..numerics.norms import rms_norm
from ..numerics.rope import rope_pairs, rope_tables
from ..serving.pools import LayerPools
from ..serving.tables import VerifyPlan
from .indexer import indexer_select


@dataclass(frozen=True)
class RowRope:
    """RoPE angles computed once per verify, as transformers' rotary module returns them: for the
    rows (labels "main" / "compress") and for each ratio's block starts (C4 / C128 entries).

    `pair(key)` gives those tables as they are (the Triton kernels rotate from them); `full`
    widens them to a head width once per verify (numerics/rope.py: rope_pairs, rope_tables) for
    the torch path's `apply_rope`."""

    raw: dict  # label or ratio -> (cos, sin) [T, rope_dim / 2], the model's dtype
    widened: dict = field(default_factory=dict)  # (label or ratio, width, inverse) -> full-width tables

    def pair(self, key) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [T, rope_dim / 2] of rows[key] (a label) or of block starts (a ratio)."""
        return self.raw[key]

    def full(self, key, width: int, inverse: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Full-width tables [1, 1, T (or E), width] of pair(key); inverse: the inverse rope's (-sin)."""
        k = (key, width, inverse)
        if k not in self.widened:
            c, s = rope_pairs(*(t.unsqueeze(0) for t in self.raw[key]))
            self.widened[k] = rope_tables(c, -s if inverse else s, width)
        return self.widened[k]


def kv_rows(attn, x, cos, sin, apply_rope) -> torch.Tensor:
    """The K=V rows (kv_norm, RoPE) a layer stores for inputs x [1, T, hidden]. -> [T, head_dim]"""
    t, d = x.shape[1], attn.head_dim
    kv = rms_norm(attn.kv_norm, attn.kv_proj(x)).view(1, t, 1, d).transpose(1, 2)
    return apply_rope(kv, cos, sin)[0, 0]


@dataclass(frozen=True)
class EntryKeys:
    """The compressed entries one layer's attention reads: per-row lists (C4: the indexer's picks;
    C128: the row's branch entries) and, for C128, its request's committed entries, a list every
    row of the request shares (read once per request by the Triton kernel)."""

    index: torch.Tensor  # [T, K] entry slots, -1 = none
    length: torch.Tensor  # [T]
    ties: torch.Tensor | None  # [T] top-k boundary ties (C4), None for C128
    shared_pages: torch.Tensor | None = None  # [B, Cp] entry pages of each request's committed entries
    shared_per_page: int = 1
    shared_len: torch.Tensor | None = None  # [B]
    req_rows: torch.Tensor | None = None  # [B, N]


def _compressed(attn, x, q_res, plan: VerifyPlan, pools: LayerPools, rope: RowRope, ops, apply_rope) -> EntryKeys:
    """Write this layer's compressor rows and branch entries; -> the entries its attention reads.
    Every row pools an entry (rows that close no block pool into the trash entry): static shapes."""
    comp = attn.compressor
    ct = plan.compress[comp.compress_rate]
    ops.compressor_write(pools.main, ct, comp, plan.out_loc, comp.kv_proj(x)[0], comp.gate_proj(x)[0], rope)
    idx = getattr(comp, "indexer", None)
    if idx is None:
        return EntryKeys(ct.branch, ct.branch_len, None, ct.entry_pages, ct.entries_per_page, ct.entry_len,
                         plan.groups.req_rows)
    t = plan.num_rows
    ops.compressor_write(pools.indexer, ct, idx, plan.out_loc, idx.kv_proj(x)[0], idx.gate_proj(x)[0], rope)
    iq = idx.q_b_proj(q_res).view(1, t, idx.num_heads, idx.head_dim).transpose(1, 2)
    iq = ops.rope_rows(iq, rope, "compress")[0].transpose(0, 1).contiguous()  # [T, HI, dI]
    iw = idx.scorer.weights_proj(x)[0].float() * idx.scorer.weights_scaling  # [T, HI]
    picked, length, ties = indexer_select(ops, iq, iw, pools.indexer.entries, ct, plan.groups,
                                          idx.scorer.softmax_scale, idx.index_topk)
    return EntryKeys(picked, length, ties)


def attention_rows(attn, x, plan: VerifyPlan, pools: LayerPools, rope: RowRope, ops, apply_rope):
    """x [1, T, hidden] -> (output [1, T, hidden], top-k boundary ties (tensor) or None).
    Writes the rows' K=V, compressor rows and branch entries into the pools first."""
    t = plan.num_rows
    q_res, q = ops.q_rows(attn, x, rope)  # [1, T, q_lora_rank], [T, H, d]
    ops.swa_write(attn, x, rope, pools.swa, plan.out_loc)
    if attn.compressor is None:
        out, _ = ops.sparse_decode(q, pools.swa, plan.swa_index, plan.swa_len, attn.sinks, attn.scaling)
        ties = None
    else:
        e = _compressed(attn, x, q_res, plan, pools, rope, ops, apply_rope)
        out, _ = ops.sparse_decode(q, pools.swa, plan.swa_index, plan.swa_len, attn.sinks, attn.scaling,
                                   pools.main.entries, e.index, e.length, e.shared_pages, e.shared_per_page,
                                   e.shared_len, e.req_rows)
        ties = e.ties
    out = ops.rope_rows(out.unsqueeze(0).transpose(1, 2), rope, attn.rope_layer_type, inverse=True).transpose(1, 2)
    grouped = attn.o_a_proj(out.reshape(1, t, attn.config.o_groups, -1)).flatten(2)
    return attn.o_b_proj(grouped), ties
