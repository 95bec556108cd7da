"""The MTP draft layer over packed rows, self-contained: mHC, sliding-window attention, MoE.

The draft layer is one DeepSeek-V4 decoder layer with compress ratio 0, so a row's context is
a list of K=V rows: some already computed (the draft cache window, rows of earlier draft
steps) and the rows being computed now. `draft_rows` takes those as one key table plus a
per-row index list into `table ++ new rows` and runs the Hugging Face modules' weights with
the torch sparse attention op (`layer_rows` is the same without the head: a draft's step 0
needs no logits for its pending rows)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention.layer import kv_rows as layer_kv_rows
from ..numerics.hc import hc_collapse, hc_head, hc_merge, hc_weights
from ..numerics.moe import moe_rows
from ..numerics.norms import rms_norm
from ..numerics.rope import apply_rope, rope_pairs, rope_tables
from ..attention.torch_ops import sparse_mqa_sink


@dataclass
class MtpRows:
    """What the draft layer computed for T rows."""

    logits: torch.Tensor  # [T, vocab]
    hidden: torch.Tensor  # [T, hc_mult, hidden] output streams (the input of child rows)
    raw: torch.Tensor  # [T, head_dim] K=V rows (normed, roped)

    def __post_init__(self) -> None:
        t = self.logits.shape[0]
        if self.hidden.shape[0] != t or self.raw.shape[0] != t:
            raise ValueError(f"MtpRows: {t} logits rows, {self.hidden.shape[0]} hidden, {self.raw.shape[0]} raw")


def layer_input(model, mtp, ids: torch.Tensor, hidden_in: torch.Tensor, positions: torch.Tensor):
    """ids [T], hidden_in [T, hc, d], positions [T] -> (h [1, T, hc, d], RoPE pair tables cos, sin
    [1, T, rope/2, 2] (numerics/rope.py))."""
    emb = model.hf.model.embed_tokens(ids.unsqueeze(0))  # [1, T, d]
    h = mtp.inputs(emb[0], hidden_in)
    label = mtp.decoder.self_attn.rope_layer_type
    cos, sin = rope_pairs(*model.hf.model.rotary_emb(emb, position_ids=positions.unsqueeze(0), layer_type=label))
    return h, cos, sin


@torch.inference_mode()
def draft_rows(model, mtp, ids: torch.Tensor, hidden_in: torch.Tensor, positions: torch.Tensor,
             table: torch.Tensor, index: torch.Tensor) -> MtpRows:
    """The draft layer over T new rows.

    ids [T] tokens; hidden_in [T, hc, d] input streams; positions [T] RoPE positions;
    table [M, head_dim] K=V rows computed earlier; index [T, K] ids into table ++ the T new
    rows (new row t is M + t), -1 = no key. Each row must list itself."""
    h, kv = layer_rows(model, mtp, ids, hidden_in, positions, table, index)
    return MtpRows(head_logits(model, mtp, h), h[0], kv)


def head_logits(model, mtp, h: torch.Tensor) -> torch.Tensor:
    """Output streams h [1, T, hc, d] -> logits [T, vocab] (hc_head, norm, the shared LM head)."""
    return model.hf.lm_head(rms_norm(mtp.norm, hc_head(mtp.hc_head, h)))[0]


@torch.inference_mode()
def layer_rows(model, mtp, ids: torch.Tensor, hidden_in: torch.Tensor, positions: torch.Tensor,
               table: torch.Tensor, index: torch.Tensor, first: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """draft_rows without the head, and only K=V for rows before `first` (a draft's step 0: the
    pending draft-extend rows need nothing else). index [T - first, K] lists keys of rows
    first.. only. -> (output streams [1, T - first, hc, d], K=V rows of all T rows [T, head_dim])."""
    layer, attn = mtp.decoder, mtp.decoder.self_attn
    nh, d = attn.num_heads, attn.head_dim
    h, c, s = layer_input(model, mtp, ids, hidden_in, positions)
    cos, sin = rope_tables(c, s, d)  # full width (numerics/rope.py): once for q, K=V and the inverse
    post, comb, collapsed = hc_weights(layer.attn_hc, h)
    x = rms_norm(layer.input_layernorm, collapsed)
    kv = layer_kv_rows(attn, x, cos, sin, apply_rope)
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
    h = hc_merge(post, comb, mlp_out, h)
    return h, kv
