"""The mHC (hyper-connection) weights of a decoder layer, in fewer ops than the module's forward.

transformers' `DeepseekV4HyperConnection.forward` computes, per row, pre / post weights and a
doubly-stochastic `comb` matrix made by `hc_sinkhorn_iters` Sinkhorn-Knopp iterations. Written
as tensor ops, each iteration is six tiny ops on an [hc, hc] matrix: at 20 iterations and two
mHC blocks per layer that is about 40% of all ops of a decode step, each paying its dispatch
cost. `hc_weights` computes the same numbers (same formulas, same order, fp32):

* one multiply-add for the three affine maps (the three scales gathered into one vector) and
  one sigmoid for pre and post;
* the Sinkhorn loop on the host through numpy when the tensor is a CPU tensor outside autograd
  (float32 sums and divisions like torch's; no device read: the data already lives there);
  elsewhere the torch loop (`sinkhorn_torch`, also the reference the tests compare against).

`hc_pre` is `hc_weights` followed by the block's input norm (the backend's mHC pre side; the
Triton backend fuses both into one kernel, kernels/hc.py). `hc_collapse` is the pre weights and the collapsed stream alone (no comb), for callers that use
only the block input (`MtpDrafter.sync`'s draft-extend rows; a draft folds the extend into its
step 0, which needs comb for its root rows); `hc_merge` folds a block's output
back into the streams; `hc_head` is the final collapse (transformers' DeepseekV4HyperHead) with
the norm fused and no no-op casts."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ..diagnostics import host_values
from .casts import as_dtype, f32
from .norms import rms_norm

_SCALE_INDEX: dict = {}


def _scale_index(hc: int, device: torch.device) -> torch.Tensor:
    """[0]*hc + [1]*hc + [2]*hc*hc: picks the pre / post / comb scale for each weight column."""
    key = (hc, device)
    if key not in _SCALE_INDEX:
        with torch.inference_mode(False):  # a normal tensor, so autograd callers can use it too
            _SCALE_INDEX[key] = torch.tensor([0] * hc + [1] * hc + [2] * hc * hc, device=device)
    return _SCALE_INDEX[key]


def sinkhorn_torch(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """transformers' loop: one column normalisation, then iters-1 (row, column) pairs."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def sinkhorn_numpy(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """The same loop on a CPU float32 tensor through numpy (fewer, cheaper calls)."""
    c, e, total = host_values(comb), np.float32(eps), np.add.reduce  # the ufunc: no Python wrapper
    c = c / (total(c, axis=-2, keepdims=True) + e)
    for _ in range(iters - 1):
        c /= total(c, axis=-1, keepdims=True) + e
        c /= total(c, axis=-2, keepdims=True) + e
    return torch.from_numpy(c)


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    if comb.device.type == "cpu" and comb.dtype == torch.float32 and not torch.is_grad_enabled():
        return sinkhorn_numpy(comb, iters, eps)
    return sinkhorn_torch(comb, iters, eps)


def _mix(module, streams: torch.Tensor) -> torch.Tensor:
    """Normed, flattened streams [B, S, hc*d] through the module's projection -> [B, S, (2+hc)*hc]."""
    b, s = streams.shape[:2]
    flat = rms_norm(module.input_norm, f32(streams.view(b, s, -1)))
    return F.linear(flat, f32(module.fn))


def _collapse(pre: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """The block input: streams [B, S, hc, d] weighted by pre [B, S, hc] and summed."""
    return as_dtype((pre.unsqueeze(-1) * streams).sum(dim=2), streams.dtype)


def hc_weights(module, streams: torch.Tensor):
    """DeepseekV4HyperConnection(streams) -> (post [B, S, hc], comb [B, S, hc, hc], collapsed [B, S, d])."""
    hc = module.hc_mult
    b, s = streams.shape[:2]
    scale = module.scale[_scale_index(hc, module.scale.device)]
    z = _mix(module, streams) * scale + module.base
    gates = torch.sigmoid(z[..., : 2 * hc])
    pre = gates[..., :hc] + module.hc_eps
    post = 2 * gates[..., hc:]
    comb = torch.softmax(z[..., 2 * hc :].view(b, s, hc, hc), dim=-1) + module.hc_eps
    comb = sinkhorn(comb, module.hc_sinkhorn_iters, module.hc_eps)
    return post, comb, _collapse(pre, streams)


def hc_pre(module, streams: torch.Tensor, norm):
    """A block's pre side: hc_weights, then the block's input norm over the collapsed input ->
    (post, comb, norm(collapsed) [B, S, d]). The torch backend's; kernels/hc.py fuses it."""
    post, comb, collapsed = hc_weights(module, streams)
    return post, comb, rms_norm(norm, collapsed)


def hc_collapse(module, streams: torch.Tensor) -> torch.Tensor:
    """Only the collapsed block input of hc_weights (no post, no comb)."""
    hc = module.hc_mult
    z = _mix(module, streams)[..., :hc] * module.scale[0] + module.base[:hc]
    return _collapse(torch.sigmoid(z) + module.hc_eps, streams)


def hc_merge(post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """The streams after a block: its output expanded by post plus the input streams mixed by
    comb (transformers' decoder layer, in the streams' dtype). streams [B, S, hc, d]."""
    dtype = streams.dtype
    mixed = torch.matmul(as_dtype(comb, dtype).transpose(-1, -2), streams)
    return as_dtype(post, dtype).unsqueeze(-1) * out.unsqueeze(-2) + mixed


def hc_head(module, streams: torch.Tensor) -> torch.Tensor:
    """DeepseekV4HyperHead(streams): streams [B, S, hc, d] -> [B, S, d] (same formulas, fp32)."""
    flat = rms_norm(module.input_norm, f32(streams.flatten(2)))
    mixes = F.linear(flat, f32(module.hc_fn))
    pre = torch.sigmoid(mixes * f32(module.hc_scale) + f32(module.hc_base)) + module.eps
    return _collapse(pre, streams)
