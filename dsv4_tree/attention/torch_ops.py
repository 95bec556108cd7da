"""The torch backend's verify hot spots, tuned for few ops (batched over all rows, fresh
tensors filled in place, no-op casts skipped). `reference/` holds the clear per-row versions
these are tested against (tests/test_torch_ops.py); the Triton kernels share these contracts.

  pool_entries           -- branch compressor: pool closing nodes' source rows into entries
  select_topk_table      -- the indexer's deterministic top-k (tie rule below), both backends
  sparse_decode          -- MQA with a per-head sink over per-row index lists into pools
  indexer_gather_scores  -- lightning-indexer scores of per-row candidate lists in a key pool
  indexer_paged_scores   -- the same for each request's committed keys through its entry pages
  indexer_topk           -- both, then the tie rule's top-k mapped to entry slots (one op per backend)
  sparse_mqa_sink        -- MQA over per-row index lists into key tables (+ shared keys): the
                            MTP drafter's attention
Tie rule (design_notes/indexer-tie-rule.md): candidates are laid out in block order (committed
entries, then the row's branch entries root-to-node); a stable descending sort keeps that
order among equal scores, so on a tie the earlier block wins."""
from __future__ import annotations

import torch

from ..numerics.casts import as_dtype, f32
from ..numerics.ties import TIE_MARGIN


def pool_entries(
    kv: torch.Tensor,
    gate: torch.Tensor,
    kv_norm,
    cos: torch.Tensor,
    sin: torch.Tensor,
    apply_rope,
) -> torch.Tensor:
    """Pool gathered source rows into compressed entries.

    kv, gate: [E, R, d]  R = m (C128) or 2m (C4: previous block's first half, then this
              block's second half); gate already includes the position bias (-inf = no row).
    cos, sin: the RoPE tables apply_rope takes, at each entry's block start w*m (transformers'
              [1, E, rope_dim/2], numerics/rope.py's pair tables [1, E, rope_dim/2, 2] or its
              full-width tables [1, 1, E, d], what the engine passes).
    Returns [E, d]: RMSNorm(sum_r softmax_r(gate) * kv), then RoPE."""
    if kv.shape[0] == 0:
        return kv.new_zeros((0, kv.shape[-1]))
    weights = gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)
    pooled = kv_norm((kv * weights).sum(dim=1)).unsqueeze(0)  # [1, E, d]
    return apply_rope(pooled.unsqueeze(1), cos, sin).squeeze(1).squeeze(0)


def topk_order(scores: torch.Tensor, topk: int):
    """The tie rule: scores [T, C] in block order (-inf = no candidate) -> (order [T, k] column
    ids best first, valid [T, k], ties [T]: 1 where the row's k-th and (k+1)-th scores are equal
    or within TIE_MARGIN relative), k = min(topk, C). A stable descending sort keeps block
    order among equal scores. No host reads."""
    t, c = scores.shape
    k = min(topk, c)
    order_scores, order = torch.sort(scores, dim=1, descending=True, stable=True)
    valid = torch.isfinite(order_scores[:, :k])
    ties = torch.zeros(t, dtype=torch.int64, device=scores.device)
    if 0 < k < c:
        edge, nxt = order_scores[:, k - 1], order_scores[:, k]
        gap_limit = TIE_MARGIN * torch.maximum(edge.abs(), nxt.abs())
        ties = (((edge - nxt) <= gap_limit) & torch.isfinite(nxt)).long()
    return order[:, :k], valid, ties


def select_topk_table(scores: torch.Tensor, cand: torch.Tensor, topk: int):
    """The tie rule over a per-row candidate table (block order; -inf = no candidate).

    scores [T, C], cand [T, C] slots. Returns (selected slots [T, k] with -1 where invalid,
    lengths [T], ties [T]), k = min(topk, C) (see topk_order)."""
    t, c = scores.shape
    if min(topk, c) == 0:
        return cand[:, :0], cand.new_zeros(t), cand.new_zeros(t)
    order, valid, ties = topk_order(scores, topk)
    selected = torch.where(valid, torch.gather(cand, 1, order), torch.full_like(cand[:, : order.shape[1]], -1))
    return selected, valid.sum(1), ties.to(cand.dtype)


def _row_keys(pool, indices: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """indices [T, K], lengths [T] -> (rows [T, K, d] fp32, valid [T, K]); columns >= lengths[t] and -1 are invalid."""
    cols = torch.arange(indices.shape[1], device=indices.device)
    valid = (indices >= 0) & (cols.unsqueeze(0) < lengths.unsqueeze(1))
    if indices.shape[1] == 0:
        return torch.zeros(*indices.shape, pool.head_dim, device=indices.device), valid
    slots = torch.where(valid, as_dtype(indices, torch.int64), -1)
    return f32(pool.read(slots)), valid


def sparse_decode(q, kv, indices, lengths, sinks, scale, extra_kv=None, extra_indices=None, extra_lengths=None,
                  shared_pages=None, shared_per_page=1, shared_len=None, req_rows=None):
    """Sparse MQA with a per-head sink, FlashMLA's sparse-decode arguments and return convention.

    q [T, H, d]; kv: a KVPool; indices [T, K] int slots into kv (-1 = none; columns >= lengths[t]
    ignored); lengths [T] int; extra_kv / extra_indices [T, K2] / extra_lengths [T]: the same into
    a second pool (or all None); sinks [H] (any float dtype, used in fp32): logit of a zero-value key per head; scale: float.
    Returns (out [T, H, d] in q.dtype, lse [T, H] fp32). lse is the log-sum-exp of the real keys'
    logits only (+inf for a row with no key, as FlashMLA); the sink enters the output as
    out = softmax-average * e^lse / (e^lse + e^sink), i.e. the softmax over keys + sink with a
    zero value for the sink. A row with no key gets out = 0.
    Optional shared list (shared_pages [B, Cp], shared_per_page, shared_len [B], req_rows [B, N]):
    every row of request b also sees the extra pool's entries of paged_slots(shared_pages, ...)[b]
    (C128's committed entries); rows in no request are then padding. Here it is expanded to
    per-row lists [T, Cp * shared_per_page]; the Triton kernel reads it once per request."""
    rows, valid = _row_keys(kv, indices, lengths)
    if extra_kv is not None:
        xrows, xvalid = _row_keys(extra_kv, extra_indices, extra_lengths)
        rows, valid = torch.cat([rows, xrows], 1), torch.cat([valid, xvalid], 1)
    if shared_pages is not None:
        row_slot, real = _row_places(req_rows, q.shape[0])
        slots = paged_slots(shared_pages, shared_per_page, shared_len)[row_slot // req_rows.shape[1]]  # [T, C]
        srows, svalid = _row_keys(extra_kv, slots, torch.full_like(row_slot, slots.shape[1]))
        rows, valid = torch.cat([rows, srows], 1), torch.cat([valid, svalid], 1) & real.unsqueeze(1)
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


def indexer_gather_scores(q, weights, keys, cand, scale, chunk: int = 2048) -> torch.Tensor:
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


def indexer_paged_scores(q, weights, keys, entry_pages, entries_per_page, entry_len, req_rows, row_slot,
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


def _row_places(req_rows: torch.Tensor, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """req_rows [B, N] (-1 = none) -> (row_slot [T] = b * N + node (0 for padding), real [T] bool)."""
    flat = as_dtype(req_rows.reshape(-1), torch.int64)
    target = torch.where(flat >= 0, flat, t)  # padding cells all land in the dropped slot t
    slot = torch.zeros(t + 1, dtype=torch.int64, device=flat.device)
    slot = slot.index_put((target,), torch.arange(flat.shape[0], device=flat.device))
    real = torch.zeros(t + 1, dtype=torch.bool, device=flat.device).index_put((target,), flat >= 0)
    return slot[:t], real[:t]


def indexer_topk(q, weights, keys, entry_pages, entries_per_page, entry_len, branch, req_rows, scale, topk):
    """The lightning indexer's top-k of every row over its request's committed keys (one batched
    product per request, indexer_paged_scores) then its own branch keys, with the tie rule.

    q [T, HI, dI]; weights [T, HI]; keys: the indexer-key pool; entry_pages [B, Cp], entry_len [B]
    (entry j of request b at slot entry_pages[b, j // epp] * epp + j % epp); branch [T, Kb] the
    row's own entry slots in block order (-1 = none); req_rows [B, N] packed row of node i of
    request b (-1 = none). Returns (selected entry slots [T, k] int64, -1 = none; lengths [T];
    ties [T]), k = min(topk, Cp * epp + Kb); rows in no request select nothing."""
    t, n, epp = q.shape[0], req_rows.shape[1], entries_per_page
    row_slot, real = _row_places(req_rows, t)
    committed = indexer_paged_scores(q, weights, keys, entry_pages, epp, entry_len, req_rows, row_slot, scale)
    own = indexer_gather_scores(q, weights, keys, branch, scale)  # [T, Kb]
    c, kb = committed.shape[1], branch.shape[1]
    order, valid, ties = topk_order(torch.cat([committed, own], 1), topk)
    j = order.clamp(max=max(c - 1, 0))
    req = (row_slot // n).unsqueeze(1)
    entry = as_dtype(entry_pages, torch.int64)[req, j // epp] * epp + j % epp
    picked = torch.where(order < c, entry, as_dtype(branch, torch.int64).gather(1, (order - c).clamp(min=0, max=kb - 1)))
    valid = valid & real.unsqueeze(1)
    return torch.where(valid, picked, -1), valid.sum(1), torch.where(real, ties, 0)


def gather_rows(table: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """table [M,d], index [N,K] (-1 = none) -> rows [N,K,d] (zeros where none), valid [N,K]."""
    valid = index >= 0
    if table.shape[0] == 0:
        return table.new_zeros((*index.shape, table.shape[-1])), valid & False
    return table[index.clamp(min=0)], valid


def sparse_mqa_sink(
    q: torch.Tensor,
    shared_kv: torch.Tensor,
    local_kv: torch.Tensor,
    local_index: torch.Tensor,
    global_kv: torch.Tensor,
    global_index: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Shared-KV multi-query attention with a per-head sink logit (zero value). K = V.

    q [N,H,d]; shared_kv [S,d]: keys every row sees (C128 committed entries);
    local_kv [M,d] with local_index [N,K1]: per-row keys in a small table (window, new rows,
    branch entries); global_kv [G,d] with global_index [N,K2]: per-row picks from a large
    table (C4 committed entries); index -1 = no key; sinks [H].
    Returns (out [N,H,d], lse [N,H]); lse includes the sink term."""
    n, h, _ = q.shape
    lk, lv = gather_rows(local_kv, local_index)
    gk, gv = gather_rows(global_kv, global_index)
    row_kv = torch.cat([lk, gk], dim=1)
    row_valid = torch.cat([lv, gv], dim=1)
    parts = []
    if shared_kv.shape[0]:
        parts.append(torch.matmul(q, shared_kv.t().unsqueeze(0)) * scale)  # [N, H, S]
    row_logits = torch.matmul(q, row_kv.transpose(1, 2)) * scale  # [N, H, K]
    parts.append(row_logits.masked_fill(~row_valid.unsqueeze(1), float("-inf")))
    parts.append(sinks.to(q.dtype).view(1, h, 1).expand(n, h, 1))
    logits = torch.cat(parts, dim=-1)
    lse = torch.logsumexp(logits, dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1, dtype=logits.dtype)
    s = shared_kv.shape[0]
    out = torch.matmul(probs[..., s : s + row_kv.shape[1]], row_kv)  # [N, H, d]
    if s:
        out = torch.matmul(probs[..., :s], shared_kv.unsqueeze(0)) + out
    return out, lse
