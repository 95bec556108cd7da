"""The DSpark forward over packed rows (checkpoint/dspark.py says what it computes).

`context_rows` turns target features into every stage's context K=V rows; `block_rows` runs
the backbone once over all requests' blocks (one pass, every request's rows together), each
block row's keys listed by `padded_block_index`; `markov_logits` / `confidences` are the heads.
Differentiable (no inference mode here): the trainer runs the same functions."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention.layer import kv_rows
from ..numerics.hc import hc_head
from ..numerics.norms import rms_norm
from ..numerics.rope import apply_rope, rope_pairs, rope_tables
from .window_layer import window_layer_rows


@dataclass
class DSparkBlock:
    """One backbone pass over B blocks of gamma rows."""

    base: torch.Tensor  # [B, gamma, vocab] U_k (before the Markov bias)
    hidden: torch.Tensor  # [B, gamma, hidden] hc-collapsed outputs before norm (confidence input)

    def __post_init__(self) -> None:
        if self.base.shape[:2] != self.hidden.shape[:2]:
            raise ValueError(f"DSparkBlock: base {tuple(self.base.shape)} and hidden {tuple(self.hidden.shape)} differ in [B, gamma]")


def _rope(model, module, like: torch.Tensor, positions: torch.Tensor):
    """Full-width RoPE tables (numerics/rope.py) of a stage layer at positions [T]."""
    attn = module.stages[0].self_attn
    c, s = rope_pairs(*model.hf.model.rotary_emb(like, position_ids=positions.unsqueeze(0), layer_type=attn.rope_layer_type))
    return rope_tables(c, s, attn.head_dim)


def context_rows(model, module, features: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """features [T, L * hidden] at positions [T] -> each stage's context K=V [S, T, head_dim]."""
    x = rms_norm(module.main_norm, module.main_proj(features.to(module.main_proj.weight.dtype))).unsqueeze(0)
    cos, sin = _rope(model, module, x, positions)
    return torch.stack([kv_rows(stage.self_attn, x, cos, sin, apply_rope) for stage in module.stages])


def padded_block_index(lengths: torch.Tensor, gamma: int, width: int) -> torch.Tensor:
    """Keys of every block row: its request's context rows and all `gamma` rows of its own block
    (gamma: the block's row count, settings.block_rows). At a fixed shape, on lengths' device (no
    host read: what a captured draft runs): request b's context at table rows b * width ..
    b * width + lengths[b] - 1 (contexts padded to `width` rows each, pack_contexts), then the
    B * gamma block rows.
    -> [B * gamma, width + gamma] ids into table ++ block rows, -1 = none."""
    b, dev = lengths.shape[0], lengths.device
    req = torch.arange(b, device=dev).unsqueeze(1)
    j = torch.arange(width, device=dev)
    ctx = torch.where(j < lengths.unsqueeze(1), req * width + j, -1)
    own = b * width + req * gamma + torch.arange(gamma, device=dev)
    keys = torch.cat([ctx, own], 1)  # [B, width + gamma]
    return keys.unsqueeze(1).expand(b, gamma, width + gamma).reshape(b * gamma, width + gamma)


def block_ids(module, anchors: torch.Tensor) -> torch.Tensor:
    """anchors [B] -> block input ids [B, rows]: the anchor, then the noise token (rows = gamma, or
    gamma + 1 without sample_from_anchor: settings.block_rows)."""
    rows = module.settings.block_rows
    noise = torch.full((anchors.shape[0], rows - 1), module.settings.noise_token_id, dtype=anchors.dtype,
                       device=anchors.device)
    return torch.cat([anchors.unsqueeze(1), noise], 1)


def block_rows(model, module, ids: torch.Tensor, starts: torch.Tensor, tables: torch.Tensor,
               index: torch.Tensor) -> DSparkBlock:
    """ids [B, rows] block input ids (block_ids); starts [B] the anchors' positions; tables [S, M,
    head_dim] context K=V per stage; index [B * rows, K] (padded_block_index). -> DSparkBlock of the gamma
    rows that predict (all rows, or rows 1..gamma without sample_from_anchor)."""
    b, gamma = ids.shape
    hf = model.hf.model
    flat = ids.reshape(-1)
    positions = (starts.unsqueeze(1) + torch.arange(gamma, device=starts.device)).reshape(-1)
    emb = hf.embed_tokens(flat.unsqueeze(0))  # [1, T, d]
    h = emb.unsqueeze(2).expand(-1, -1, model.config.hc_mult, -1).contiguous()
    cos, sin = _rope(model, module, emb, positions)
    for stage, table in zip(module.stages, tables):
        h, _ = window_layer_rows(stage, h, cos, sin, table, index, flat)
    first = gamma - module.block_size  # 1 without sample_from_anchor: the anchor row predicts nothing
    collapsed = hc_head(module.hc_head, h).view(b, gamma, -1)[:, first:]  # [B, block_size, d]
    base = model.hf.lm_head(rms_norm(module.norm, collapsed))
    return DSparkBlock(base, collapsed)


def markov_logits(module, base: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """base [..., vocab] U_k, prev [...] the previous tokens -> U_k + W2 W1[prev], fp32 [..., vocab]."""
    return base.float() + module.markov_bias(prev).float()


def markov_walk(module, blk: DSparkBlock, anchors: torch.Tensor):
    """The Markov head left to right, greedy. -> (tokens [B, gamma + 1]: the anchor, then the
    drafts; logits [B, gamma, V] fp32)."""
    prev, toks, logits = anchors, [anchors], []
    for k in range(module.block_size):
        lk = markov_logits(module, blk.base[:, k], prev)  # [B, V]
        prev = lk.argmax(-1)
        logits.append(lk)
        toks.append(prev)
    return torch.stack(toks, 1), torch.stack(logits, 1)


def confidences(module, hidden: torch.Tensor, prev: torch.Tensor, temperature=None) -> torch.Tensor:
    """hidden [..., hidden], prev [...] -> c [...] fp32; temperature: STS temperature(s) of these
    depths (None: 1), broadcast to [...]."""
    return module.confidence_of(hidden, prev, temperature)
