"""Torch reference implementations of the verify hot spots (fp32-friendly, written for clarity).

  ref_pool_entries      -- branch compressor: pool closing nodes' source rows into entries
                           (the torch backend's op, yardstick of kernels.pool_entries)
  topk_order            -- the indexer's deterministic top-k order (tie rule below), shared by
                           both backends and both candidate forms
  select_topk_table     -- topk_order over a per-row candidate table
  ref_sparse_mqa_sink   -- MQA over per-row index lists into key tables (+ shared keys), sink;
                           the MTP drafter's attention
The serving-layout ops (sparse decode, indexer scores over pools) are in sparse_decode.py.
Tie rule (design_notes/indexer-tie-rule.md): candidates are laid out in block order (committed
entries, then the row's branch entries root-to-node); a stable descending sort keeps that
order among equal scores, so on a tie the earlier block wins.
"""
from __future__ import annotations

import torch


def ref_pool_entries(
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
              [1, E, rope_dim/2], model/rope.py's pair tables [1, E, rope_dim/2, 2] or its
              full-width tables [1, 1, E, d], what the engine passes).
    Returns [E, d]: RMSNorm(sum_r softmax_r(gate) * kv), then RoPE."""
    if kv.shape[0] == 0:
        return kv.new_zeros((0, kv.shape[-1]))
    weights = gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)
    pooled = kv_norm((kv * weights).sum(dim=1)).unsqueeze(0)  # [1, E, d]
    return apply_rope(pooled.unsqueeze(1), cos, sin).squeeze(1).squeeze(0)


TIE_MARGIN = 1e-4  # relative score gap at the top-k boundary reported as a (near-)tie


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


def gather_rows(table: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """table [M,d], index [N,K] (-1 = none) -> rows [N,K,d] (zeros where none), valid [N,K]."""
    valid = index >= 0
    if table.shape[0] == 0:
        return table.new_zeros((*index.shape, table.shape[-1])), valid & False
    return table[index.clamp(min=0)], valid


def ref_sparse_mqa_sink(
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
