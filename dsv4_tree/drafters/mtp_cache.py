"""The MTP drafter's own draft-layer cache and the key tables of a draft step.

DraftCache holds, per request, the draft layer's K=V rows of the last `sliding_window`
committed positions (plain tensors) and the target streams at seq_len - 1 (the next root
row's input). The row at position p >= 1 pairs x_p with the target's streams at p - 1: SGLang's
draft-extend rows (its row t pairs x_{t+1} with the streams at t), placed one position later
(RoPE is relative); no row pairs x_0 with anything, so position 0 has no K=V row. A draft brings the caches up to their requests after prefill/commit (the
draft-extend step, from the target streams the engine left in Request.new_hidden) inside its
step 0: `root_step` folds that draft-extend into the step: the pending rows and the root rows
go through the layer in one pass (`fold_back` then stores the pending rows' K=V).
`window_index` lists, for draft rows at one depth, the window rows they may attend to."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..diagnostics import host_values
from ..errors import StateError


@dataclass
class DraftCache:
    """Draft-layer state of one request: rows for positions seq_len - w .. seq_len - 1."""

    window: torch.Tensor  # [w, head_dim] K=V rows, w <= sliding_window
    seq_len: int
    prev_hidden: torch.Tensor  # [hc_mult, hidden] target streams at seq_len - 1 (unset, zeros, at 0)

    @classmethod
    def empty(cls, model) -> "DraftCache":
        c = model.config
        kw = dict(dtype=model.dtype, device=model.device)
        return cls(torch.empty(0, c.head_dim, **kw), 0, torch.zeros(c.hc_mult, c.hidden_size, **kw))


def pending_rows(model, cache: DraftCache, req):
    """(ids, input streams, positions, last target streams) of the rows to compute for req: the
    positions from max(cache.seq_len, seq_len - window, 1) to seq_len - 1 (none at 0)."""
    new = req.seq_len - cache.seq_len
    w = model.window
    need = min(new, w + 1)
    if new < 0 or req.new_hidden is None or req.new_hidden.shape[0] < need:
        have = None if req.new_hidden is None else req.new_hidden.shape[0]
        raise StateError(f"MTP drafter is {new} rows behind request {req.request_id} but the request carries "
                         f"hidden states for {have}; draft after every prefill and commit")
    first = max(cache.seq_len, req.seq_len - w, 1)  # rows before it fall out of the window; none at 0
    streams = req.new_hidden[-need:].to(model.device)  # positions seq_len - need .. seq_len - 1
    base = req.seq_len - need
    prev = [cache.prev_hidden.unsqueeze(0)] if first == cache.seq_len else []  # streams at first - 1
    hid = torch.cat(prev + [streams[max(0, first - 1 - base) : need - 1]])
    ids = req.tokens[first : req.seq_len].to(model.device)
    positions = torch.arange(first, req.seq_len, device=model.device)
    return ids, hid, positions, streams[-1]


@dataclass
class RootStep:
    """Step 0 of a draft with the draft-extend folded in. Rows: every request's pending rows
    (positions cache.seq_len .. seq_len - 1, at most the window), then one root row per request
    (the pending token at seq_len). `table` is the caches' windows before the extend. Only the
    root rows attend (mtp_rows.layer_rows with first = num_pending; a pending row needs only
    its K=V); a root row's index lists its visible window rows, its request's pending rows and
    itself."""

    ids: torch.Tensor  # [T]
    hidden_in: torch.Tensor  # [T, hc, d]
    positions: torch.Tensor  # [T]
    table: torch.Tensor  # [M, head_dim]
    index: torch.Tensor  # [B, K] the root rows' keys: ids into table ++ the T rows, -1 = none
    pending: list  # per request: (number of pending rows, target streams at seq_len - 1 or None)
    num_pending: int  # rows before the roots


def root_step(model, caches: list, requests: list) -> RootStep:
    """The rows and index lists of step 0 for requests whose caches may lag behind them."""
    w, dev = model.window, model.device
    table = torch.cat([c.window for c in caches])
    m = table.shape[0]
    parts = [pending_rows(model, c, r) if r.seq_len != c.seq_len else None for c, r in zip(caches, requests)]
    counts = [0 if p is None else p[0].shape[0] for p in parts]
    e = sum(counts)
    # a root row at seq_len sees its old window as a draft row n (= its pending rows) deep would,
    # and its pending rows (laid out after the table, positions seq_len - n ..) as a window at depth 0
    pending = torch.tensor(counts)
    old = window_index(torch.tensor([c.window.shape[0] for c in caches]), pending, 1, w)
    new = window_index(pending, 0, 1, w)
    roots_self = (m + e + torch.arange(len(caches))).unsqueeze(1)
    index = torch.cat([old, torch.where(new >= 0, new + m, new), roots_self], 1).to(dev)
    todo = [p for p in parts if p is not None]
    roots = torch.tensor([r.root_token for r in requests], device=dev)
    last = [c.prev_hidden if p is None else p[3] for c, p in zip(caches, parts)]
    seq = torch.tensor([r.seq_len for r in requests], device=dev)
    return RootStep(torch.cat([p[0] for p in todo] + [roots]),
                    torch.cat([p[1] for p in todo] + [torch.stack(last)]),
                    torch.cat([p[2] for p in todo] + [seq]), table, index,
                    [(n, None if p is None else p[3]) for n, p in zip(counts, parts)], e)


def fold_back(model, step: RootStep, caches: list, requests: list, raw: torch.Tensor) -> None:
    """Store the pending rows' K=V (raw [T, head_dim] of the step's rows) in the caches."""
    start = 0
    for cache, req, (n, last) in zip(caches, requests, step.pending):
        if last is not None:
            store_rows(model, cache, req, raw[start : start + n], last)
            start += n


def store_rows(model, cache: DraftCache, req, rows: torch.Tensor, last: torch.Tensor) -> None:
    """Append a request's new K=V rows to its window (keeping the last `window`) and its streams."""
    cache.window = torch.cat([cache.window, rows])[-model.window :]
    cache.seq_len = req.seq_len
    cache.prev_hidden = last.clone()


def window_index(lengths: torch.Tensor, depth, rows_per_request: int, window: int, device=None) -> torch.Tensor:
    """Window keys of the draft rows at `depth` (position seq_len + depth), per request.

    lengths [B] window rows per request (positions seq_len - w .. seq_len - 1; host bookkeeping,
    a CPU tensor), laid out back to back from table row 0; depth: an int, or a CPU tensor [B]
    (one per request). Returns [B * rows_per_request,
    max(lengths)] table ids on `device`, -1 = not visible (row j of request b, position
    seq_len - w + j, is visible when within the window). Built on the host: no device read."""
    width = int(host_values(lengths).max()) if lengths.numel() else 0
    offsets = torch.cumsum(lengths, 0) - lengths
    j = torch.arange(width, device=lengths.device).unsqueeze(0)  # [1, width]
    lo = (lengths + depth - window + 1).unsqueeze(1)  # first visible j
    ok = (j < lengths.unsqueeze(1)) & (j >= lo)
    idx = torch.where(ok, offsets.unsqueeze(1) + j, torch.full_like(j, -1))  # [B, width]
    return idx.repeat_interleave(rows_per_request, dim=0).to(device if device is not None else lengths.device)
