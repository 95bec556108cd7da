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

from ..attention.layer import kv_rows
from ..numerics.hc import hc_collapse, hc_head
from ..numerics.norms import rms_norm
from ..numerics.rope import apply_rope, rope_pairs, rope_tables
from .window_layer import window_layer_rows


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
    h, c, s = layer_input(model, mtp, ids, hidden_in, positions)
    cos, sin = rope_tables(c, s, mtp.decoder.self_attn.head_dim)  # full width (numerics/rope.py)
    return window_layer_rows(mtp.decoder, h, cos, sin, table, index, ids, first)


@torch.inference_mode()
def draft_kv_rows(model, mtp, ids: torch.Tensor, hidden_in: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The K=V rows the draft layer stores for these inputs ([T, head_dim]): a row's K=V
    depends on its own input alone (a draft-extend in a pass of its own, MtpDrafter.sync)."""
    h, cos, sin = layer_input(model, mtp, ids, hidden_in, positions)
    layer = mtp.decoder
    return kv_rows(layer.self_attn, rms_norm(layer.input_layernorm, hc_collapse(layer.attn_hc, h)), cos, sin,
                   apply_rope)
