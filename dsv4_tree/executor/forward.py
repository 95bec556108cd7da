"""Run verify rows through every layer: per-token modules from Hugging Face, attention ours."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention.layer import RowRope, attention_rows
from ..serving.tables import VerifyPlan
from ..numerics.hc import hc_head
from ..numerics.moe import moe_rows
from ..numerics.norms import rms_norm
from ..numerics.rope import apply_rope


@dataclass
class RowsRun:
    """Output of one forward over verify rows (all tensors; nothing read on the host)."""

    logits: torch.Tensor  # [rows kept, vocab] (all T rows, or the requested subset)
    topk_ties: torch.Tensor  # [T] per row: layers whose indexer top-k boundary was a (near-)tie
    hidden: torch.Tensor  # [T, hc_mult, hidden] residual streams before hc_head (MTP input)
    # per row, the output streams of each `feature_layers` layer averaged over the hc streams,
    # concatenated in ascending layer order (a DSpark drafter's context, as SGLang's V4 layer
    # loop captures it: design_notes/dspark.md); None when none were asked for
    features: torch.Tensor | None = None  # [T, len(feature_layers) * hidden]


def row_rope(model, plan: VerifyPlan, like: torch.Tensor) -> RowRope:
    """RoPE angles of every row and of every ratio's block starts, once per verify: one call of
    the model's rotary module per label (the block starts ride with the "compress" rows)."""
    rot = model.hf.model.rotary_emb
    t = plan.num_rows
    ratios = sorted(plan.compress)
    main = rot(like, position_ids=plan.positions.unsqueeze(0), layer_type="main")
    pos = torch.cat([plan.positions] + [plan.compress[m].block_start for m in ratios]) if ratios else plan.positions
    comp = rot(like, position_ids=pos.unsqueeze(0), layer_type="compress")
    raw = {"main": (main[0][0], main[1][0])}
    for i, key in enumerate(["compress"] + ratios):
        raw[key] = (comp[0][0, i * t : (i + 1) * t], comp[1][0, i * t : (i + 1) * t])
    return RowRope(raw)


def decoder_layer_rows(layer, h, plan: VerifyPlan, pools, rope: RowRope, ops, ids):
    """One DeepseekV4DecoderLayer (mHC, attention, MoE) over packed rows. h [1, T, hc, hidden]."""
    post, comb, x = ops.hc_pre(layer.attn_hc, h, layer.input_layernorm)
    attn_out, ties = attention_rows(layer.self_attn, x, plan, pools, rope, ops, apply_rope)
    h = ops.hc_post(post, comb, attn_out, h)
    post, comb, x = ops.hc_pre(layer.ffn_hc, h, layer.post_attention_layernorm)
    mlp_out = moe_rows(layer.mlp, x, ids)
    return ops.hc_post(post, comb, mlp_out, h), ties


@torch.inference_mode()
def run_rows(model, plan: VerifyPlan, pools: list, ops, logit_rows: torch.Tensor | None = None,
             feature_layers: tuple = ()) -> RowsRun:
    """plan: tables on the model's device; pools: LayerPools per layer (rows written into them).
    logit_rows: packed rows to keep logits for (device tensor); feature_layers: layer ids whose
    output streams (mean over hc) RowsRun.features keeps, in ascending layer order. The MoE layers pick their experts
    implementation themselves (numerics/moe.py)."""
    hf = model.hf.model
    ids = plan.input_ids.unsqueeze(0)
    emb = hf.embed_tokens(ids)  # [1, T, hidden]
    h = emb.unsqueeze(2).expand(-1, -1, model.config.hc_mult, -1).contiguous()
    rope = row_rope(model, plan, emb)
    ties = torch.zeros(plan.num_rows, dtype=torch.int64, device=emb.device)
    seen = {}
    for i, (layer, layer_pools) in enumerate(zip(hf.layers, pools)):
        h, n_ties = decoder_layer_rows(layer, h, plan, layer_pools, rope, ops, ids)
        if n_ties is not None:
            ties = ties + n_ties
        if i in feature_layers:
            seen[i] = h[0].mean(1)
    hidden = h[0]
    if logit_rows is not None:
        h = h[:, logit_rows]
    logits = model.hf.lm_head(rms_norm(hf.norm, hc_head(hf.hc_head, h)))[0]
    features = torch.cat([seen[i] for i in sorted(feature_layers)], -1) if feature_layers else None
    return RowsRun(logits, ties, hidden, features)
