"""Run verify rows through every layer: per-token modules from Hugging Face, attention ours."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention.layer import RowRope, attention_rows
from ..attention.plan import VerifyPlan
from .hf_bindings import apply_rotary_pos_emb


@dataclass
class RowsRun:
    """Output of one forward over verify rows."""

    logits: torch.Tensor  # [rows kept, vocab] (all T rows, or the requested subset)
    layers: list  # LayerRows per layer, for commit
    topk_ties: torch.Tensor  # [T] int64 per row: C4 layers whose indexer top-k boundary was a tie
    hidden: torch.Tensor  # [T, hc_mult, hidden] residual streams before hc_head (MTP input)


def row_rope(model, plan: VerifyPlan, like: torch.Tensor) -> RowRope:
    """cos/sin for every row and every branch entry's block start, once per verify."""
    rot = model.hf.model.rotary_emb
    pos = plan.positions.to(like.device).unsqueeze(0)
    rows = {label: rot(like, position_ids=pos, layer_type=label) for label in ("main", "compress")}
    blocks = {}
    for b, rp in enumerate(plan.requests):
        for m, cp in rp.compress.items():
            start = (cp.blocks * m).to(like.device).unsqueeze(0)
            blocks[(b, m)] = rot(like, position_ids=start, layer_type="compress")
    return RowRope(rows, blocks)


def decoder_layer_rows(layer, h, plan: VerifyPlan, layer_caches, rope: RowRope, ops, ids):
    """One DeepseekV4DecoderLayer (mHC, attention, MoE) over packed rows. h [1, T, hc, hidden]."""
    dtype = h.dtype
    post, comb, collapsed = layer.attn_hc(h)
    attn_out, rows, ties = attention_rows(
        layer.self_attn, layer.input_layernorm(collapsed), plan, layer_caches, rope, ops, apply_rotary_pos_emb
    )
    h = post.to(dtype).unsqueeze(-1) * attn_out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), h)
    post, comb, collapsed = layer.ffn_hc(h)
    mlp_out = layer.mlp(layer.post_attention_layernorm(collapsed), input_ids=ids)
    h = post.to(dtype).unsqueeze(-1) * mlp_out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), h)
    return h, rows, ties


@torch.no_grad()
def run_rows(model, plan: VerifyPlan, caches, ops, logit_rows: torch.Tensor | None = None) -> RowsRun:
    """caches: RequestCache per request (read only). logit_rows: packed rows to keep logits for."""
    hf = model.hf.model
    ids = plan.input_ids.to(model.device).unsqueeze(0)
    emb = hf.embed_tokens(ids)  # [1, T, hidden]
    h = emb.unsqueeze(2).expand(-1, -1, model.config.hc_mult, -1).contiguous()
    rope = row_rope(model, plan, emb)
    layers, ties = [], torch.zeros(plan.num_rows, dtype=torch.int64, device=emb.device)
    for li, layer in enumerate(hf.layers):
        h, rows, n_ties = decoder_layer_rows(layer, h, plan, [c.layers[li] for c in caches], rope, ops, ids)
        layers.append(rows)
        ties += n_ties
    hidden = h[0]
    if logit_rows is not None:
        h = h[:, logit_rows.to(h.device, non_blocking=True)]
    logits = model.hf.lm_head(hf.norm(hf.hc_head(h)))[0]
    return RowsRun(logits, layers, ties, hidden)
