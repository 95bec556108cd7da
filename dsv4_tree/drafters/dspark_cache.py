"""The DSpark drafter's per-request state: each stage's context K=V of the last window rows.

The engine leaves, after each prefill and commit, the target features of the rows it added in
`Request.new_features` (positions seq_len - n .. seq_len - 1). A draft first brings every
request's context up to its request in one `context_rows` call over all requests' pending rows
(only the last `window` of them can matter), then the block attends to it."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import StateError
from ..executor.graphs import pack_windows
from .dspark_rows import context_rows


@dataclass
class DSparkContext:
    """Context K=V of one request: positions seq_len - w .. seq_len - 1 (w <= window) per stage."""

    tables: torch.Tensor  # [S, w, head_dim]
    seq_len: int

    @classmethod
    def empty(cls, model, module) -> "DSparkContext":
        s, d = module.settings.num_stages, model.config.head_dim
        return cls(torch.empty(s, 0, d, dtype=model.dtype, device=model.device), 0)


def pending_features(model, ctx: DSparkContext, req) -> tuple[torch.Tensor, torch.Tensor]:
    """(features [n, L * hidden], positions [n]) of the rows req committed since ctx, at most the window."""
    new = req.seq_len - ctx.seq_len
    need = min(new, model.window)
    have = None if req.new_features is None else req.new_features.shape[0]
    if new < 0 or have is None or have < need:
        raise StateError(f"DSpark drafter is {new} rows behind request {req.request_id} but the request carries "
                         f"target features for {have}; register the drafter with the engine before prefill "
                         "(Engine.register_drafter, or pass it to generate) and draft after every commit")
    feats = req.new_features[have - need:]
    positions = torch.arange(req.seq_len - need, req.seq_len, device=model.device)
    return feats, positions


def bring_up(model, module, contexts: list, requests: list) -> None:
    """Append every request's pending rows to its context (one context_rows call for all)."""
    parts = [pending_features(model, c, r) if r.seq_len != c.seq_len else None for c, r in zip(contexts, requests)]
    todo = [p for p in parts if p is not None]
    if not todo:
        return
    rows = context_rows(model, module, torch.cat([p[0] for p in todo]).to(model.device),
                        torch.cat([p[1] for p in todo]))  # [S, E, head_dim]
    start = 0
    for ctx, req, part in zip(contexts, requests, parts):
        if part is None:
            continue
        n = part[1].numel()
        ctx.tables = torch.cat([ctx.tables, rows[:, start:start + n]], 1)[:, -model.window:]
        ctx.seq_len = req.seq_len
        start += n


def pack_contexts(contexts: list, width: int) -> tuple[torch.Tensor, list]:
    """Every request's context padded to `width` rows, back to back: (tables [S, B * width,
    head_dim] (request b's rows first in its slot, zeros after), lengths [B] on the host); the
    keys padded_block_index lists for it."""
    return pack_windows([c.tables for c in contexts], width, dim=1)
