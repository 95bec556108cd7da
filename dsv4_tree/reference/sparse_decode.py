"""Torch references of the serving-layout ops (FlashMLA sparse-decode argument form)."""
from __future__ import annotations

import torch


def _gather(pool, indices: torch.Tensor, lengths: torch.Tensor):
    cols = torch.arange(indices.shape[1], device=indices.device)
    valid = (indices >= 0) & (cols.unsqueeze(0) < lengths.unsqueeze(1))
    return pool.read(torch.where(valid, indices, -1)), valid


def ref_sparse_decode(q, kv, indices, lengths, sinks, scale, extra_kv=None, extra_indices=None, extra_lengths=None):
    """Shared-KV MQA (K = V) over per-row slot lists into paged pools, with a per-head sink.

    q [T, H, d]; indices [T, K] int slots into kv (-1 = none; columns >= lengths[t] ignored);
    extra_*: a second pool and its lists (C4 / C128 entries); sinks [H]: logit of a zero-value key.
    Returns (out [T, H, d] in q.dtype, lse [T, H] fp32 over real keys only)."""
    keys, valid = _gather(kv, indices, lengths)
    if extra_kv is not None:
        ek, ev = _gather(extra_kv, extra_indices, extra_lengths)
        keys, valid = torch.cat([keys, ek], 1), torch.cat([valid, ev], 1)
    logits = torch.matmul(q, keys.transpose(1, 2)) * scale  # [T, H, K]
    logits = logits.masked_fill(~valid.unsqueeze(1), float("-inf"))
    t, h = q.shape[:2]
    sink = sinks.to(q.dtype).view(1, h, 1).expand(t, h, 1)
    full = torch.cat([logits, sink], -1)
    probs = torch.softmax(full - full.amax(-1, keepdim=True), dim=-1)
    out = torch.matmul(probs[..., :-1], keys)
    return out, torch.logsumexp(logits.float(), dim=-1)


def ref_indexer_gather_scores(q, weights, keys, cand, scale, chunk: int = 4096):
    """score[t, c] = scale * sum_h weights[t, h] * relu(q[t, h] . key[cand[t, c]]), -inf where
    cand < 0. q [T, HI, dI]; weights [T, HI] fp32; keys a pool; cand [T, C]. -> [T, C] fp32"""
    t, c = cand.shape
    out = torch.full((t, c), float("-inf"), dtype=torch.float32, device=q.device)
    qf, wf = q.float(), weights.float().unsqueeze(-1)
    for s in range(0, c, chunk):
        idx = cand[:, s : s + chunk]
        k = keys.read(idx).float()  # [T, c', dI]
        sc = (torch.relu(torch.matmul(qf, k.transpose(1, 2))) * scale * wf).sum(1)
        out[:, s : s + chunk] = sc.masked_fill(idx < 0, float("-inf"))
    return out
