"""Clear torch references of the verify hot spots, fp32, one row (or entry) at a time. The
torch backend's batched versions (attention/torch_ops.py) and the Triton kernels (kernels/)
are tested against these; nothing on the verify path calls them.

  ref_pool_entries     -- branch compressor: pool closing nodes' source rows into entries
  ref_select_topk      -- the indexer's top-k with the tie rule, by sorting each row's list
  ref_sparse_mqa_sink  -- MQA over per-row key lists (+ keys every row sees) with a sink
The serving-layout ops (sparse decode, indexer scores over pools) are in sparse_decode.py.
Tie rule (design_notes/indexer-tie-rule.md): candidates are laid out in block order (committed
entries, then the row's branch entries root-to-node); among equal scores the earlier one wins.
"""
from __future__ import annotations

import torch

from ..numerics.ties import TIE_MARGIN  # the rule's near-tie margin (one definition)


def ref_pool_entries(kv: torch.Tensor, gate: torch.Tensor, kv_norm, cos: torch.Tensor, sin: torch.Tensor,
                     apply_rope) -> torch.Tensor:
    """Pool gathered source rows into compressed entries.

    kv, gate: [E, R, d]  R = m (C128) or 2m (C4: previous block's first half, then this
              block's second half); gate already includes the position bias (-inf = no row).
    cos, sin: the RoPE tables apply_rope takes, at each entry's block start (any of the forms
              attention/torch_ops.pool_entries documents).
    Returns [E, d]: RMSNorm(sum_r softmax_r(gate) * kv), then RoPE."""
    pooled = []
    for e in range(kv.shape[0]):
        weights = torch.softmax(gate[e].float(), dim=0)  # [R, d]: one softmax per channel over the rows
        pooled.append((weights * kv[e].float()).sum(dim=0).to(kv.dtype))
    if not pooled:
        return kv.new_zeros((0, kv.shape[-1]))
    normed = kv_norm(torch.stack(pooled)).unsqueeze(0).unsqueeze(1)  # [1, 1, E, d]
    return apply_rope(normed, cos, sin).reshape(kv.shape[0], -1)


def ref_select_topk(scores: torch.Tensor, cand: torch.Tensor, topk: int):
    """The tie rule, row by row. scores [T, C] (-inf = no candidate), cand [T, C] slots.
    Returns (selected [T, k] slots, -1 where fewer valid, lengths [T], ties [T]), k = min(topk, C);
    ties[t] = 1 when the k-th and (k+1)-th best scores are equal or within TIE_MARGIN relative."""
    t, c = scores.shape
    k = min(topk, c)
    selected = torch.full((t, k), -1, dtype=cand.dtype)
    lengths, ties = torch.zeros(t, dtype=cand.dtype), torch.zeros(t, dtype=cand.dtype)
    for row in range(t):
        s = scores[row].tolist()
        order = sorted(range(c), key=lambda j: (-s[j], j))  # best first, earlier column on a tie
        picked = [j for j in order[:k] if s[j] != float("-inf")]
        selected[row, : len(picked)] = cand[row, picked]
        lengths[row] = len(picked)
        if 0 < k < c and s[order[k]] != float("-inf"):
            edge, nxt = s[order[k - 1]], s[order[k]]
            ties[row] = int(edge - nxt <= TIE_MARGIN * max(abs(edge), abs(nxt)))
    return selected, lengths, ties


def ref_sparse_mqa_sink(q: torch.Tensor, shared_kv: torch.Tensor, local_kv: torch.Tensor, local_index: torch.Tensor,
                        global_kv: torch.Tensor, global_index: torch.Tensor, sinks: torch.Tensor,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Shared-KV multi-query attention with a per-head sink logit (zero value). K = V.

    q [N,H,d]; shared_kv [S,d]: keys every row sees; local_kv [M,d] with local_index [N,K1] and
    global_kv [G,d] with global_index [N,K2]: per-row keys by index (-1 = no key); sinks [H].
    Returns (out [N,H,d], lse [N,H]); lse includes the sink term."""
    outs, lses = [], []
    for n in range(q.shape[0]):
        keys = torch.cat([shared_kv, local_kv[local_index[n][local_index[n] >= 0]],
                          global_kv[global_index[n][global_index[n] >= 0]]]).float()  # [K, d]
        logits = torch.cat([q[n].float() @ keys.t() * scale, sinks.float().view(-1, 1)], dim=1)  # [H, K + 1]
        probs = torch.softmax(logits, dim=1)
        outs.append(probs[:, :-1] @ keys)
        lses.append(torch.logsumexp(logits, dim=1))
    return torch.stack(outs).to(q.dtype), torch.stack(lses).to(q.dtype)
