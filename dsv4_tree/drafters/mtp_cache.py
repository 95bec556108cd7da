"""The MTP drafter's own draft-layer cache and the key tables of a draft step.

DraftCache holds, per request, the draft layer's K=V rows of the last `sliding_window`
committed positions (plain tensors) and the target streams at seq_len - 1 (the next root
row's input). `extend` brings a batch of caches up to their requests after prefill/commit
(the draft-extend step), from the target streams the engine left in Request.new_hidden.
`window_index` lists, for draft rows at one depth, the window rows they may attend to."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import StateError
from .mtp_rows import kv_rows


@dataclass
class DraftCache:
    """Draft-layer state of one request: rows for positions seq_len - w .. seq_len - 1."""

    window: torch.Tensor  # [w, head_dim] K=V rows, w <= sliding_window
    seq_len: int
    prev_hidden: torch.Tensor  # [hc_mult, hidden] target streams at seq_len - 1 (zeros at 0)

    @classmethod
    def empty(cls, model) -> "DraftCache":
        c = model.config
        kw = dict(dtype=model.dtype, device=model.device)
        return cls(torch.empty(0, c.head_dim, **kw), 0, torch.zeros(c.hc_mult, c.hidden_size, **kw))


def _pending(model, cache: DraftCache, req):
    """(ids, input streams, positions, last target streams) of the rows to compute for req."""
    new = req.seq_len - cache.seq_len
    w = model.window
    need = min(new, w + 1)
    if new < 0 or req.new_hidden is None or req.new_hidden.shape[0] < need:
        have = None if req.new_hidden is None else req.new_hidden.shape[0]
        raise StateError(f"MTP drafter is {new} rows behind request {req.request_id} but the request carries "
                         f"hidden states for {have}; draft after every prefill and commit")
    first = max(cache.seq_len, req.seq_len - w)  # rows before it fall out of the window
    streams = req.new_hidden[-need:].to(model.device)  # positions seq_len - need .. seq_len - 1
    base = req.seq_len - need
    prev = [cache.prev_hidden.unsqueeze(0)] if first == cache.seq_len else []
    hid = torch.cat(prev + [streams[max(0, first - 1 - base) : need - 1]])
    ids = req.tokens[first : req.seq_len].to(model.device)
    positions = torch.arange(first, req.seq_len, device=model.device)
    return ids, hid, positions, streams[-1]


def extend(model, mtp, caches: list, requests: list) -> None:
    """Draft-extend every cache behind its request, all requests in one pass of the layer."""
    todo = [(c, r) for c, r in zip(caches, requests) if r.seq_len != c.seq_len]
    if not todo:
        return
    parts = [_pending(model, c, r) for c, r in todo]
    raw = kv_rows(model, mtp, torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]),
                  torch.cat([p[2] for p in parts]))
    start = 0
    for (cache, req), (ids, _, _, last) in zip(todo, parts):
        rows = raw[start : start + ids.shape[0]]
        start += ids.shape[0]
        cache.window = torch.cat([cache.window, rows])[-model.window :]
        cache.seq_len = req.seq_len
        cache.prev_hidden = last.clone()


def window_index(lengths: torch.Tensor, depth: int, rows_per_request: int, window: int, device=None) -> torch.Tensor:
    """Window keys of the draft rows at `depth` (position seq_len + depth), per request.

    lengths [B] window rows per request (positions seq_len - w .. seq_len - 1; host bookkeeping,
    a CPU tensor), laid out back to back from table row 0. Returns [B * rows_per_request,
    max(lengths)] table ids on `device`, -1 = not visible (row j of request b, position
    seq_len - w + j, is visible when within the window). Built on the host: no device read."""
    width = int(lengths.max()) if lengths.numel() else 0
    offsets = torch.cumsum(lengths, 0) - lengths
    j = torch.arange(width, device=lengths.device).unsqueeze(0)  # [1, width]
    lo = (lengths + depth - window + 1).unsqueeze(1)  # first visible j
    ok = (j < lengths.unsqueeze(1)) & (j >= lo)
    idx = torch.where(ok, offsets.unsqueeze(1) + j, torch.full_like(j, -1))  # [B, width]
    return idx.repeat_interleave(rows_per_request, dim=0).to(device if device is not None else lengths.device)
