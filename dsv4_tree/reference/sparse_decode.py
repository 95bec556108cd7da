"""Torch references of the serving-layout ops that read paged KV pools (FlashMLA argument form).

  ref_sparse_decode          -- MQA with a per-head sink over per-row index lists into one or two
                                pools (main: SWA rows; extra: C4 / C128 entries), K = V
  ref_indexer_gather_scores  -- lightning-indexer scores of per-row candidate lists in a key pool
  ref_indexer_paged_scores   -- the same for the committed keys of each request, through the
                                request's entry page table: one pass per request for all its rows

Pools are read only through `pool.read(slots)` (dequantised rows in the pool's compute dtype,
slot -1 -> zeros), so these references hold for every storage dtype; the math is fp32."""
from __future__ import annotations

import torch

from ..model.casts import as_dtype, f32


def _row_keys(pool, indices: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """indices [T, K], lengths [T] -> (rows [T, K, d] fp32, valid [T, K]); columns >= lengths[t] and -1 are invalid."""
    cols = torch.arange(indices.shape[1], device=indices.device)
    valid = (indices >= 0) & (cols.unsqueeze(0) < lengths.unsqueeze(1))
    if indices.shape[1] == 0:
        return torch.zeros(*indices.shape, pool.head_dim, device=indices.device), valid
    slots = torch.where(valid, as_dtype(indices, torch.int64), -1)
    return f32(pool.read(slots)), valid


def ref_sparse_decode(q, kv, indices, lengths, sinks, scale, extra_kv=None, extra_indices=None, extra_lengths=None):
    """Sparse MQA with a per-head sink, FlashMLA's sparse-decode arguments and return convention.

    q [T, H, d]; kv: a KVPool; indices [T, K] int slots into kv (-1 = none; columns >= lengths[t]
    ignored); lengths [T] int; extra_kv / extra_indices [T, K2] / extra_lengths [T]: the same into
    a second pool (or all None); sinks [H] (any float dtype, used in fp32): logit of a zero-value key per head; scale: float.
    Returns (out [T, H, d] in q.dtype, lse [T, H] fp32). lse is the log-sum-exp of the real keys'
    logits only (+inf for a row with no key, as FlashMLA); the sink enters the output as
    out = softmax-average * e^lse / (e^lse + e^sink), i.e. the softmax over keys + sink with a
    zero value for the sink. A row with no key gets out = 0."""
    rows, valid = _row_keys(kv, indices, lengths)
    if extra_kv is not None:
        xrows, xvalid = _row_keys(extra_kv, extra_indices, extra_lengths)
        rows, valid = torch.cat([rows, xrows], 1), torch.cat([valid, xvalid], 1)
    logits = torch.matmul(f32(q), rows.transpose(1, 2)) * scale  # [T, H, K + K2]
    invalid = ~valid.unsqueeze(1)
    logits.masked_fill_(invalid, float("-inf"))  # a fresh product (its backward needs only the inputs)
    lse = torch.logsumexp(logits, dim=-1)  # [T, H]; -inf where no key
    sink = f32(sinks).view(1, -1).expand_as(lse)
    total = torch.logaddexp(lse, sink)  # normaliser of keys + sink
    probs = torch.exp(logits - total.unsqueeze(-1)).masked_fill(invalid, 0.0)  # exp's output: autograd keeps it
    out = torch.matmul(probs, rows)  # [T, H, d]
    lse = torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)
    return as_dtype(out, q.dtype), lse


def ref_indexer_gather_scores(q, weights, keys, cand, scale, chunk: int = 2048) -> torch.Tensor:
    """score[t, c] = scale * sum_h weights[t, h] * relu(q[t, h] . key[cand[t, c]]), -inf where cand < 0.

    q [T, HI, dI]; weights [T, HI] (the indexer's per-head weights, already including its
    head-count scaling, as transformers' DeepseekV4IndexerScorer computes them); keys: a KVPool of
    indexer keys; cand [T, C] int slots (-1 = none); scale: float (index_head_dim ** -0.5).
    Returns [T, C] fp32. Candidates are processed `chunk` columns at a time, so the [T, HI, chunk]
    intermediate stays bounded."""
    t, c = cand.shape
    out = torch.empty(t, c, dtype=torch.float32, device=q.device)
    qf, wf = f32(q), f32(weights).unsqueeze(-1)
    for start in range(0, c, chunk):
        ids = cand[:, start : start + chunk]
        k = f32(keys.read(torch.where(ids < 0, -1, as_dtype(ids, torch.int64))))  # [T, chunk, dI]
        s = torch.relu(torch.matmul(qf, k.transpose(1, 2))) * scale  # [T, HI, chunk]
        out[:, start : start + ids.shape[1]] = (s * wf).sum(dim=1).masked_fill(ids < 0, float("-inf"))
    return out


def paged_slots(entry_pages, entries_per_page: int, entry_len) -> torch.Tensor:
    """Page form -> slots [B, C] (C = pages x entries_per_page), -1 at and past entry_len[b]."""
    epp = entries_per_page
    slots = (as_dtype(entry_pages, torch.int64).unsqueeze(2) * epp + torch.arange(epp, device=entry_pages.device)).flatten(1)
    cols = torch.arange(slots.shape[1], device=slots.device)
    return torch.where(cols < entry_len.unsqueeze(1), slots, -1)


def ref_indexer_paged_scores(q, weights, keys, entry_pages, entries_per_page, entry_len, req_rows, row_slot,
                             scale) -> torch.Tensor:
    """score[t, c] = scale * sum_h weights[t, h] * relu(q[t, h] . key[slot of entry c of the row's
    request]), -inf for c >= that request's entry_len (DeepGEMM's paged MQA logits).

    q [T, HI, dI]; weights [T, HI]; keys: a KVPool of indexer keys; entry_pages [B, Cp] int: entry
    c of request b sits at slot entry_pages[b, c // epp] * epp + c % epp (epp = entries_per_page);
    entry_len [B]; req_rows [B, N] packed rows of each request (-1 = none); row_slot [T] =
    request * N + the row's node id (a padding row reads slot 0). Returns [T, Cp * epp] fp32. A
    request's keys are read once and scored for all its rows in one batched product
    [B, N * HI, C] (no loop over candidate chunks: the same ops whatever C)."""
    slots = paged_slots(entry_pages, entries_per_page, entry_len)  # [B, C]
    b, c = slots.shape
    n, (_, h, d) = req_rows.shape[1], q.shape
    rows = req_rows.clamp(min=0)
    qg = f32(q)[rows].view(b, n * h, d)  # [B, N*HI, dI]
    wg = f32(weights)[rows]  # [B, N, HI]
    k = f32(keys.read(slots))  # [B, C, dI]
    s = torch.relu(torch.matmul(qg, k.transpose(1, 2))).view(b, n, h, c)  # [B, N, HI, C]
    s = torch.matmul(wg.unsqueeze(2), s).squeeze(2) * scale  # [B, N, C]: the head-weighted sum
    s = s.masked_fill(slots.unsqueeze(1) < 0, float("-inf"))
    return s.view(b * n, c)[row_slot]
