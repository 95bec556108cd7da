"""One DeepSeek-V4 attention block over verify rows, reading the plan and the committed cache.

Reuses the Hugging Face module's weights and helpers (projections, norms, RoPE); replaces how
the block reads its context: per-row sliding windows, committed + branch compressed entries,
per-row indexer top-k."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .compress import branch_entries
from .plan import VerifyPlan


@dataclass
class CompressorRows:
    """New projections of one compressor for every verify row, and the entries they closed."""

    kv: torch.Tensor  # [T, channels]
    gate: torch.Tensor  # [T, channels]
    entries: list  # per request: [E_b, head_dim] branch entries, in CompressPlan.closing order


@dataclass
class LayerRows:
    """What one layer computed for the verify rows; commit reads it, nothing else does."""

    raw: torch.Tensor  # [T, head_dim] K=V rows (normed, roped)
    main: CompressorRows | None
    indexer: CompressorRows | None


@dataclass(frozen=True)
class RowRope:
    """cos/sin computed once per verify: for rows ("main"/"compress") and entry block starts."""

    rows: dict  # rope label -> (cos, sin) [1, T, rope_dim/2]
    blocks: dict  # (request index, ratio) -> (cos, sin) [1, E, rope_dim/2]


def kv_rows(attn, x, cos, sin, apply_rope) -> torch.Tensor:
    """The K=V rows (kv_norm, RoPE) a layer stores for inputs x [1, T, hidden]. -> [T, head_dim]"""
    t, d = x.shape[1], attn.head_dim
    kv = attn.kv_norm(attn.kv_proj(x)).view(1, t, 1, d).transpose(1, 2)
    return apply_rope(kv, cos, sin)[0, 0]


def attention_rows(attn, x, plan: VerifyPlan, layer_caches, rope: RowRope, ops, apply_rope):
    """x [1, T, hidden] -> (output [1, T, hidden], LayerRows, tie [T] bool: the row's indexer
    top-k boundary is a (near-)tie; on the device, never read here)."""
    t = plan.num_rows
    h, d = attn.num_heads, attn.head_dim
    cos, sin = rope.rows[attn.rope_layer_type]
    q_res = attn.q_a_norm(attn.q_a_proj(x))
    q = attn.q_b_norm(attn.q_b_proj(q_res).view(1, t, h, d).transpose(1, 2))
    q = apply_rope(q, cos, sin)[0].transpose(0, 1)  # [T, H, d]
    kv = kv_rows(attn, x, cos, sin, apply_rope)  # [T, d]
    comp = attn.compressor
    main = index = None
    iq = iw = None
    if comp is not None:
        main = CompressorRows(comp.kv_proj(x)[0], comp.gate_proj(x)[0], [])
        idx = getattr(comp, "indexer", None)
        if idx is not None:
            index = CompressorRows(idx.kv_proj(x)[0], idx.gate_proj(x)[0], [])
            ccos, csin = rope.rows["compress"]
            iq = idx.q_b_proj(q_res).view(1, t, idx.num_heads, idx.head_dim).transpose(1, 2)
            iq = apply_rope(iq, ccos, csin)[0].transpose(0, 1)  # [T, HI, dI]
            iw = idx.scorer.weights_proj(x)[0].float() * idx.scorer.weights_scaling  # [T, HI]
    outs = []
    ties = torch.zeros(t, dtype=torch.bool, device=kv.device)
    empty = kv.new_zeros((0, d))
    for b, rp in enumerate(plan.requests):
        rows = slice(rp.row_offset, rp.row_offset + rp.num_nodes)
        cache = layer_caches[b]
        local_index = rp.swa_index
        shared, global_kv = empty, empty
        global_index = rp.swa_index.new_zeros((rp.num_nodes, 0))
        parts = [cache.window, kv[rows]]
        if comp is not None:
            cp = rp.compress[comp.compress_rate]
            cs = rope.blocks[(b, comp.compress_rate)]
            ent = branch_entries(cache.main, main.kv[rows], main.gate[rows], cp, comp, cs, apply_rope, ops.pool_entries)
            main.entries.append(ent)
            parts.append(ent)
            if index is not None:
                ient = branch_entries(
                    cache.indexer, index.kv[rows], index.gate[rows], cp, comp.indexer, cs, apply_rope, ops.pool_entries
                )
                index.entries.append(ient)
                sel, valid, n_ties = ops.indexer_topk(
                    iq[rows], iw[rows], cache.indexer.entries.rows, ient, cp.visible,
                    comp.indexer.index_topk, comp.indexer.scorer.softmax_scale,
                )
                ties[rows] = n_ties
                c = cp.committed
                none = torch.full_like(sel, -1)
                global_kv = cache.main.entries.rows
                global_index = torch.where(valid & (sel < c), sel, none)
                extra = torch.where(valid & (sel >= c), rp.local_offset + sel - c, none)
                local_index = torch.cat([local_index, extra], dim=1)
            else:
                shared = cache.main.entries.rows
                local_index = rp.swa_branch_index[comp.compress_rate]
        local_kv = torch.cat(parts)
        out, _ = ops.sparse_mqa_sink(q[rows], shared, local_kv, local_index, global_kv, global_index,
                                     attn.sinks, attn.scaling)
        outs.append(out)
    out = torch.cat(outs).unsqueeze(0)  # [1, T, H, d]
    out = apply_rope(out.transpose(1, 2), cos, -sin).transpose(1, 2)
    grouped = attn.o_a_proj(out.reshape(1, t, attn.config.o_groups, -1)).flatten(2)
    return attn.o_b_proj(grouped), LayerRows(kv, main, index), ties
