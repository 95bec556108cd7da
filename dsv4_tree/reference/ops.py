"""Torch reference implementations of the verify hot spots (fp32-friendly, written for clarity).

These are the torch backend itself and the yardstick for every kernel:
  ref_pool_entries      -- branch compressor: pool closing nodes' source rows into entries
  ref_indexer_topk      -- lightning-indexer scores + deterministic top-k (tie rule below)
  ref_sparse_mqa_sink   -- shared-KV MQA over per-row index lists into key tables (+ shared keys), sink
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
    cos, sin: [1, E, rope_dim/2] rope at each entry's block start w*m.
    Returns [E, d]: RMSNorm(sum_r softmax_r(gate) * kv), then RoPE."""
    if kv.shape[0] == 0:
        return kv.new_zeros((0, kv.shape[-1]))
    weights = gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)
    pooled = kv_norm((kv * weights).sum(dim=1)).unsqueeze(0)  # [1, E, d]
    return apply_rope(pooled.unsqueeze(1), cos, sin).squeeze(1).squeeze(0)


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, scale: float,
                   chunk: int = 8192) -> torch.Tensor:
    """sum_h weights[n,h] * relu(q[n,h] . keys[e]) * scale.  q [N,H,D], weights [N,H], keys [E,D] -> [N,E]

    Keys are scored in chunks so the [N, H, chunk] intermediate stays bounded at long context."""
    out = q.new_empty((q.shape[0], keys.shape[0]), dtype=torch.float32)
    qf, wf = q.float(), weights.float().unsqueeze(-1)
    for start in range(0, keys.shape[0], chunk):
        k = keys[start : start + chunk].float()
        scores = torch.relu(torch.matmul(qf, k.t().unsqueeze(0))) * scale  # [N, H, chunk]
        out[:, start : start + k.shape[0]] = (scores * wf).sum(dim=1)
    return out


TIE_MARGIN = 1e-4  # relative score gap at the top-k boundary reported as a (near-)tie


def select_topk(committed_scores: torch.Tensor, branch_scores: torch.Tensor, branch_visible: torch.Tensor,
                topk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tie rule (shared by every backend): candidates in block order, stable descending sort.

    committed_scores [N,C]; branch_scores [N,E] (all branch entries); branch_visible [N,V].
    Returns (selected [N,k] ids into committed++branch, valid [N,k], tie [N] bool: rows whose
    k-th and (k+1)-th scores are equal or within TIE_MARGIN relative, where the choice is ours
    alone). Everything stays on the scores' device: counting ties never waits for it."""
    n, c = committed_scores.shape
    vis_ok = branch_visible >= 0
    if branch_visible.shape[1] and branch_scores.shape[1]:
        sb = torch.gather(branch_scores, 1, branch_visible.clamp(min=0))
    else:
        sb = committed_scores.new_zeros((n, branch_visible.shape[1]))
    sb = sb.masked_fill(~vis_ok, float("-inf"))
    scores = torch.cat([committed_scores, sb], dim=1)  # [N, C + V]
    ids = torch.cat(
        [torch.arange(c, device=scores.device).expand(n, c), c + branch_visible.clamp(min=0)], dim=1
    )
    k = min(topk, scores.shape[1])
    order_scores, order = torch.sort(scores, dim=1, descending=True, stable=True)
    selected = torch.gather(ids, 1, order[:, :k])
    valid = torch.isfinite(order_scores[:, :k])
    tie = torch.zeros(n, dtype=torch.bool, device=scores.device)
    if 0 < k < scores.shape[1]:
        edge, nxt = order_scores[:, k - 1], order_scores[:, k]
        # a boundary within rounding of a tie: another implementation may choose differently
        gap_limit = TIE_MARGIN * torch.maximum(edge.abs(), nxt.abs())
        tie = ((edge - nxt) <= gap_limit) & torch.isfinite(nxt)
    return selected, valid, tie


def select_topk_table(scores: torch.Tensor, cand: torch.Tensor, topk: int):
    """The tie rule over a per-row candidate table (block order; -inf = no candidate).

    scores [T, C], cand [T, C] slots. Returns (selected slots [T, k] with -1 where invalid,
    lengths [T], ties [T]: 1 where the row's k-th and (k+1)-th scores are equal or within
    TIE_MARGIN relative), k = min(topk, C). No host reads: everything stays a tensor."""
    t, c = scores.shape
    k = min(topk, c)
    if k == 0:
        return cand[:, :0], cand.new_zeros(t), cand.new_zeros(t)
    order_scores, order = torch.sort(scores, dim=1, descending=True, stable=True)
    valid = torch.isfinite(order_scores[:, :k])
    selected = torch.where(valid, torch.gather(cand, 1, order[:, :k]), torch.full_like(cand[:, :k], -1))
    ties = cand.new_zeros(t)
    if k < c:
        edge, nxt = order_scores[:, k - 1], order_scores[:, k]
        gap_limit = TIE_MARGIN * torch.maximum(edge.abs(), nxt.abs())
        ties = (((edge - nxt) <= gap_limit) & torch.isfinite(nxt)).to(cand.dtype)
    return selected, valid.sum(1), ties


def ref_indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    committed_keys: torch.Tensor,
    branch_keys: torch.Tensor,
    branch_visible: torch.Tensor,
    topk: int,
    scale: float,
    scores_fn=indexer_scores,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k compressed entries per row over committed + the row's own branch entries.

    q [N,H,D]; weights [N,H]; committed_keys [C,D] (every row sees all); branch_keys [E,D];
    branch_visible [N,V] branch entry ids the row sees, in block order, -1 = none.
    Returns (selected [N,k] ids into committed++branch, valid [N,k] bool, tie [N] bool: the
    row's top-k boundary is a (near-)tie), k = min(topk, C + V)."""
    sc = scores_fn(q, weights, committed_keys, scale)  # [N, C]
    sb = scores_fn(q, weights, branch_keys, scale)  # [N, E]
    return select_topk(sc, sb, branch_visible, topk)


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
