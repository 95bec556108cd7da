"""Clear torch references of the serving-layout ops that read paged KV pools (FlashMLA argument
form), one row at a time in fp32.

  ref_sparse_decode          -- MQA with a per-head sink over per-row index lists into one or two
                                pools (main: SWA rows; extra: C4 / C128 entries), K = V
  ref_indexer_gather_scores  -- lightning-indexer scores of per-row candidate lists in a key pool
  ref_indexer_paged_scores   -- the same for the committed keys of each request, through the
                                request's entry page table: one pass per request for all its rows

Pools are read only through `pool.read(slots)` (dequantised rows in the pool's compute dtype),
so these hold for every storage dtype."""
from __future__ import annotations

import torch


def _keys(pool, indices: torch.Tensor, length) -> torch.Tensor:
    """One row's keys: the valid (>= 0) slots among its first `length` indices, fp32 [K, d]."""
    slots = indices[: int(length)]
    slots = slots[slots >= 0].long()
    return pool.read(slots).float() if slots.numel() else torch.zeros(0, pool.head_dim, device=indices.device)


def ref_sparse_decode(q, kv, indices, lengths, sinks, scale, extra_kv=None, extra_indices=None, extra_lengths=None,
                      shared_pages=None, shared_per_page=1, shared_len=None, req_rows=None):
    """Sparse MQA with a per-head sink, FlashMLA's sparse-decode arguments and return convention.

    q [T, H, d]; kv: a KVPool; indices [T, K] int slots into kv (-1 = none; columns >= lengths[t]
    ignored); lengths [T]; extra_kv / extra_indices [T, K2] / extra_lengths [T]: the same into a
    second pool (or all None); sinks [H]: logit of a zero-value key per head; scale: float.
    Optional shared list (all or none): shared_pages [B, Cp], shared_len [B], req_rows [B, N]:
    every row of request b (req_rows[b], -1 = none) also sees the extra pool's slots
    shared_pages[b, j // e] * e + j % e for j < shared_len[b] (e = shared_per_page: C128's
    committed entries); with it, rows in no request are padding (no key).
    Returns (out [T, H, d] in q.dtype, lse [T, H] fp32): lse is the log-sum-exp of the real keys'
    logits (+inf for a row with no key); out is the softmax over keys + sink times the keys (the
    sink's value is zero), 0 for a row with no key."""
    outs, lses = [], []
    request_of = {}
    if shared_pages is not None:
        request_of = {int(r): b for b, rows in enumerate(req_rows.tolist()) for r in rows if r >= 0}
    for t in range(q.shape[0]):
        keys = _keys(kv, indices[t], lengths[t])
        if extra_kv is not None:
            keys = torch.cat([keys, _keys(extra_kv, extra_indices[t], extra_lengths[t])])
        if shared_pages is not None:
            if t in request_of:
                b, e = request_of[t], shared_per_page
                j = torch.arange(int(shared_len[b]), device=q.device)
                keys = torch.cat([keys, _keys(extra_kv, shared_pages[b].long()[j // e] * e + j % e, j.numel())])
            else:
                keys = keys[:0]
        logits = q[t].float() @ keys.t() * scale  # [H, K]
        if keys.shape[0] == 0:
            outs.append(torch.zeros(q.shape[1], q.shape[2], device=q.device))
            lses.append(torch.full((q.shape[1],), float("inf"), device=q.device))
            continue
        with_sink = torch.cat([logits, sinks.float().view(-1, 1)], dim=1)
        outs.append(torch.softmax(with_sink, dim=1)[:, :-1] @ keys)
        lses.append(torch.logsumexp(logits, dim=1))
    return torch.stack(outs).to(q.dtype), torch.stack(lses)


def ref_indexer_gather_scores(q, weights, keys, cand, scale) -> torch.Tensor:
    """score[t, c] = scale * sum_h weights[t, h] * relu(q[t, h] . key[cand[t, c]]), -inf where cand < 0.

    q [T, HI, dI]; weights [T, HI] (the indexer's per-head weights, head-count scaling included);
    keys: a KVPool of indexer keys; cand [T, C] int slots (-1 = none); scale: float.
    Returns [T, C] fp32."""
    out = torch.full(cand.shape, float("-inf"), device=q.device)
    for t in range(cand.shape[0]):
        ok = cand[t] >= 0
        if not ok.any():
            continue
        k = keys.read(cand[t][ok].long()).float()  # [C', dI]
        per_head = torch.relu(q[t].float() @ k.t()) * scale  # [HI, C']
        out[t, ok] = (weights[t].float().view(-1, 1) * per_head).sum(dim=0)
    return out


def ref_indexer_paged_scores(q, weights, keys, entry_pages, entries_per_page, entry_len, req_rows, row_slot,
                             scale) -> torch.Tensor:
    """score[t, c] = scale * sum_h weights[t, h] * relu(q[t, h] . key[slot of entry c of the row's
    request]), -inf for c >= that request's entry_len (DeepGEMM's paged MQA logits).

    q [T, HI, dI]; weights [T, HI]; keys: a KVPool of indexer keys; entry_pages [B, Cp] int: entry
    c of request b sits at slot entry_pages[b, c // epp] * epp + c % epp (epp = entries_per_page);
    entry_len [B]; req_rows [B, N] (unused here: each row is scored alone); row_slot [T] = request *
    N + the row's node id. Returns [T, Cp * epp] fp32, row by row through ref_indexer_gather_scores."""
    epp, n = entries_per_page, req_rows.shape[1]
    c = entry_pages.shape[1] * epp
    out = torch.full((q.shape[0], c), float("-inf"), device=q.device)
    for t in range(q.shape[0]):
        b = int(row_slot[t]) // n
        cols = torch.arange(c, device=q.device)
        slots = entry_pages[b].long().repeat_interleave(epp) * epp + cols % epp
        cand = torch.where(cols < entry_len[b], slots, -1).unsqueeze(0)
        out[t] = ref_indexer_gather_scores(q[t : t + 1], weights[t : t + 1], keys, cand, scale)[0]
    return out
