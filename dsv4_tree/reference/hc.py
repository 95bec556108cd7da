"""References for the mHC boundary kernels (kernels/hc.py): transformers' own modules.

ref_hc_pre(module, streams, norm): streams [B, S, hc, d] -> (post [B, S, hc], comb [B, S, hc, hc],
    norm(collapsed) [B, S, d]): `DeepseekV4HyperConnection(streams)` (fp32 inside, its Sinkhorn
    loop), then the block's input RMSNorm module over the collapsed input.
ref_hc_post(post, comb, out, streams): the streams after the block, transformers' decoder-layer
    formula `post * out + comb^T @ streams` in the streams' dtype (numerics/hc.py writes it once:
    hc_merge)."""
from __future__ import annotations

import torch

from ..numerics.hc import hc_merge


@torch.no_grad()
def ref_hc_pre(module, streams: torch.Tensor, norm):
    post, comb, collapsed = module(streams)
    return post, comb, norm(collapsed)


def ref_hc_post(post, comb, out, streams):
    return hc_merge(post, comb, out, streams)
