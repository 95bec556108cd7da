"""One sliding-window DeepSeek-V4 decoder layer (compress ratio 0) over packed rows: mHC,
MQA with sink over per-row key lists, MoE. The draft layers of the MTP and DSpark drafters.

A row's keys are K=V rows, some computed earlier (`table`) and the rows being computed now:
`index` lists, per row, ids into `table ++ new rows` (new row t is len(table) + t)."""
from __future__ import annotations

import torch

from ..attention.layer import kv_rows
from ..attention.torch_ops import sparse_mqa_sink
from ..numerics.hc import hc_merge, hc_weights
from ..numerics.moe import moe_rows
from ..numerics.norms import rms_norm
from ..numerics.rope import apply_rope


def window_layer_rows(layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, table: torch.Tensor,
                      index: torch.Tensor, ids: torch.Tensor, first: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """layer: a DeepseekV4DecoderLayer (sliding window); h [1, T, hc, d] input streams; cos, sin
    full-width RoPE tables of the T rows (numerics/rope.rope_tables); table [M, head_dim];
    index [T - first, K] keys of rows first.. (-1 = none; each row lists itself); ids [T] tokens
    (MoE routing). Rows before `first` get only their K=V.
    -> (output streams [1, T - first, hc, d], K=V rows of all T rows [T, head_dim])."""
    attn = layer.self_attn
    nh, d = attn.num_heads, attn.head_dim
    post, comb, collapsed = hc_weights(layer.attn_hc, h)
    x = rms_norm(layer.input_layernorm, collapsed)
    kv = kv_rows(attn, x, cos, sin, apply_rope)
    if first:
        h, post, comb, x = h[:, first:], post[:, first:], comb[:, first:], x[:, first:]
        cos, sin, ids = cos[:, :, first:], sin[:, :, first:], ids[first:]
    t = ids.shape[0]
    q = attn.q_b_proj(rms_norm(attn.q_a_norm, attn.q_a_proj(x))).view(1, t, nh, d).transpose(1, 2)
    q = apply_rope(rms_norm(attn.q_b_norm, q), cos, sin)[0].transpose(0, 1)  # [T, H, d]
    keys = torch.cat([table, kv])
    none = kv.new_zeros((0, d))
    out, _ = sparse_mqa_sink(q, none, keys, index, none, index.new_zeros((t, 0)), attn.sinks, attn.scaling)
    out = apply_rope(out.unsqueeze(0).transpose(1, 2), cos, -sin).transpose(1, 2)  # [1, T, H, d] (inverse)
    attn_out = attn.o_b_proj(attn.o_a_proj(out.reshape(1, t, attn.config.o_groups, -1)).flatten(2))
    h = hc_merge(post, comb, attn_out, h)
    post, comb, collapsed = hc_weights(layer.ffn_hc, h)
    mlp_out = moe_rows(layer.mlp, rms_norm(layer.post_attention_layernorm, collapsed), ids.unsqueeze(0))
    return hc_merge(post, comb, mlp_out, h), kv
