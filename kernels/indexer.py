"""Lightning-indexer scoring: score[n, e] = scale * sum_h w[n,h] * relu(q[n,h] . k[e]).

One program owns a tile of index keys and loops over the rows of the request, so every key
tile is loaded once for all rows (the committed candidates are shared by every row). Top-k
then uses the shared tie rule (dsv4_tree.reference.select_topk).
The dot runs on fp32 tiles with input_precision="ieee" (never Triton's TF32 default).
Reference: dsv4_tree.reference.indexer_scores."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4_tree.reference.ops import select_topk

from ._launch import FLOATS, check, check_device, pow2
from ._tiles import load_rows


@triton.jit
def _indexer_scores_kernel(q_ptr, w_ptr, k_ptr, out_ptr, N, H, E, D, scale,
                           BE: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr):
    pid = tl.program_id(0)
    re = pid * BE + tl.arange(0, BE)
    rd = tl.arange(0, BD)
    rh = tl.arange(0, BH)
    keys = load_rows(k_ptr, re, re < E, rd, D)
    for n in range(0, N):
        q = load_rows(q_ptr, n * H + rh, rh < H, rd, D)
        w = tl.load(w_ptr + n * H + rh, mask=rh < H, other=0.0).to(tl.float32)
        s = tl.maximum(tl.dot(q, tl.trans(keys), input_precision="ieee"), 0.0) * scale  # [BH, BE]
        score = tl.sum(s * w[:, None], axis=0)
        tl.store(out_ptr + n * E + re, score, mask=re < E)


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """q [N,H,D], weights [N,H], keys [E,D] -> [N,E] fp32."""
    check("q", q, 3, FLOATS, contiguous=False)  # small; copied to a packed layout below
    check("weights", weights, 2, FLOATS, contiguous=False)
    check("keys", keys, 2, FLOATS)
    n, h, d = q.shape
    if weights.shape != (n, h):
        raise ValueError(f"weights must be [N={n}, H={h}], got {tuple(weights.shape)}")
    if keys.shape[1] != d:
        raise ValueError(f"keys have width {keys.shape[1]}, q has {d}")
    check_device(q, weights, keys)
    out = torch.empty(n, keys.shape[0], dtype=torch.float32, device=q.device)
    if keys.shape[0] == 0 or n == 0:
        return out
    be = 32
    _indexer_scores_kernel[(triton.cdiv(keys.shape[0], be),)](
        q.contiguous(), weights.float().contiguous(), keys, out, n, h, keys.shape[0], d, scale,
        BE=be, BH=pow2(h), BD=pow2(d))
    return out


def indexer_topk(q, weights, committed_keys, branch_keys, branch_visible, topk, scale):
    """Same contract as ref_indexer_topk, scores from the kernel."""
    sc = indexer_scores(q, weights, committed_keys, scale)
    sb = indexer_scores(q, weights, branch_keys, scale)
    return select_topk(sc, sb, branch_visible, topk)
