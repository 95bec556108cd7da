"""mHC boundary kernels (kernels/hc.py) against transformers' modules (reference/hc.py), under
TRITON_INTERPRET=1 at tiny shapes, fp32 and bf16, hc 2 and 4.

Bounds (u = 2^-24, fp32 unit roundoff), derived from what differs between kernel and reference:
* hc_pre: both compute z = rms_normed(flat) @ fn^T * scale + base in fp32; only the order of the
  K = hc*d-term sums differs, so |dz| <= K u (|flat| @ |fn|^T) |scale| + 2u|z| (the norm's
  mean square adds K u relative to r). That perturbation is carried to post and comb by the
  map's own Jacobian (float64 autograd of the same formulas, first order), and each of the
  2 * iters + 1 normalisations (softmax, Sinkhorn) rounds its entries once more, (hc + 2) u
  relative each. The collapsed input sums hc fp32 products (hc u), its norm is scale-free
  (relative error passes through, twice for the mean square), and a bf16 output may round to the
  neighbouring value when the fp32 values straddle a rounding point: one bf16 ulp (2^-8 rel.).
* hc_post: the same roundings as torch's ops in the same places (bf16 products exact in fp32);
  only the hc-term comb^T @ streams sum is reordered: each side within hc u sum|comb s| of the
  exact sum in fp32 (2 hc u apart, plus u per side for the final add), which in bf16
  can move the rounded mixed term (then the sum) by one ulp each: 2^-8 (|mixed| + |result|).
bf16 roundings in the kernels go through kernels/_rounding.py: triton 3.9's interpreter
truncates a plain fp32 -> bf16 cast, a GPU rounds to nearest even; rounding on the bits first
makes both agree, and these tests would fail by one ulp on truncation."""
import pytest
import torch

import dsv4_tree as dt
from dsv4_tree import kernels
from dsv4_tree.numerics.hc import sinkhorn_torch
from dsv4_tree.reference.hc import ref_hc_post, ref_hc_pre
from test_hc import hc_module

U = 2.0**-24


def hc_layer(hc_mult: int, seed: int, dtype):
    hf, layer, d = hc_module(hc_mult, seed)
    return layer.to(dtype), d


def _z_and_dz(module, streams):
    """z in float64 and the bound on the kernel's |dz| (module above)."""
    flat = streams.double().flatten(2)
    k = flat.shape[-1]
    normed = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + module.input_norm.eps)
    fn, hc = module.fn.double(), module.hc_mult
    scale = module.scale.double()[torch.tensor([0] * hc + [1] * hc + [2] * hc * hc)]
    z = normed @ fn.T * scale + module.base.double()
    dz = (k + 1) * U * (normed.abs() @ fn.abs().T) * scale.abs() + 2 * U * z.abs()
    dz = dz + k * U * (normed @ fn.T).abs() * scale.abs()  # the mean square: K u relative on r
    return z, dz


def _weights64(module, z):
    hc = module.hc_mult
    gates = torch.sigmoid(z[..., : 2 * hc])
    comb = torch.softmax(z[..., 2 * hc :].unflatten(-1, (hc, hc)), -1) + module.hc_eps
    comb = sinkhorn_torch(comb, module.hc_sinkhorn_iters, module.hc_eps)
    return torch.cat([gates[..., :hc] + module.hc_eps, 2 * gates[..., hc:], comb.flatten(-2)], -1)


def _bounds(module, streams, norm, post, comb, x):
    """Per-element bounds on |kernel - reference| for (post, comb, x)."""
    hc, d = module.hc_mult, streams.shape[-1]
    z, dz = _z_and_dz(module, streams)
    out = torch.zeros(z.shape[:-1] + (2 * hc + hc * hc,), dtype=torch.float64)
    for b in range(z.shape[0]):
        for s in range(z.shape[1]):
            jac = torch.autograd.functional.jacobian(lambda v: _weights64(module, v), z[b, s])
            out[b, s] = jac.abs() @ dz[b, s]
    w = _weights64(module, z)
    rounding = (2 * module.hc_sinkhorn_iters + 1) * (hc + 2) * U
    pre, d_pre = w[..., :hc], out[..., :hc] + 2 * U * w[..., :hc]
    d_post = out[..., hc : 2 * hc] + 2 * U * w[..., hc : 2 * hc]
    d_comb = out[..., 2 * hc :].unflatten(-1, (hc, hc)) + rounding * w[..., 2 * hc :].unflatten(-1, (hc, hc))
    s64 = streams.double()
    c = (pre.unsqueeze(-1) * s64).sum(-2)
    dc = (d_pre.unsqueeze(-1) * s64.abs()).sum(-2) + hc * U * (pre.unsqueeze(-1) * s64).abs().sum(-2)
    if streams.dtype != torch.float32:
        dc = dc + 2.0**-8 * c.abs()  # the collapsed input may round to the neighbouring bf16
    rms = c.square().mean(-1, keepdim=True).sqrt()
    rel = dc.abs().max(-1, keepdim=True).values / rms  # a perturbation of c, relative to its scale
    dx = norm.weight.double().abs() * (dc + 2 * rel * c.abs()) / rms + 4 * U * x.double().abs()
    if streams.dtype != torch.float32:
        dx = dx + 2.0**-8 * x.double().abs()  # one bf16 rounding of the output
    return d_post, d_comb, dx


@pytest.mark.parametrize("hc_mult", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_pre_kernel_matches_the_modules(hc_mult, dtype):
    layer, d = hc_layer(hc_mult, seed=3 + hc_mult, dtype=dtype)
    streams = torch.randn(1, 5, hc_mult, d).to(dtype)
    for module, norm in ((layer.attn_hc, layer.input_layernorm), (layer.ffn_hc, layer.post_attention_layernorm)):
        want = ref_hc_pre(module, streams, norm)
        with torch.inference_mode():
            got = kernels.hc_pre(module, streams, norm)
        for w, g, name in zip(want, got, ("post", "comb", "x")):
            assert g.dtype == w.dtype and g.shape == w.shape, (name, g.dtype, w.dtype, g.shape, w.shape)
        bounds = _bounds(module, streams, norm, *want)
        for w, g, bound, name in zip(want, got, bounds, ("post", "comb", "x")):
            err = (g.double() - w.double()).abs()
            assert (err <= bound).all(), f"{name} {hc_mult=} {dtype=}: worst {float((err - bound).max())} over the bound"


@pytest.mark.parametrize("hc_mult", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_post_kernel_matches_the_decoder_layer_formula(hc_mult, dtype):
    layer, d = hc_layer(hc_mult, seed=11 + hc_mult, dtype=dtype)
    streams = torch.randn(2, 3, hc_mult, d).to(dtype)
    post, comb, _ = ref_hc_pre(layer.attn_hc, streams, layer.input_layernorm)
    out = torch.randn(2, 3, d).to(dtype)
    want = ref_hc_post(post, comb, out, streams)
    with torch.inference_mode():
        got = kernels.hc_post(post, comb, out, streams)
    assert got.dtype == want.dtype and got.shape == want.shape
    mixed = torch.matmul(comb.to(dtype).double().transpose(-1, -2), streams.double())
    terms = torch.matmul(comb.to(dtype).double().abs().transpose(-1, -2), streams.double().abs())
    if dtype == torch.float32:
        # each side's mixed term is within hc u sum|comb s| of the exact sum (with or without
        # fused multiply-adds), and each final addition within u of its own exact sum
        bound = 2 * hc_mult * U * terms + 2 * U * want.double().abs()
    else:
        bound = 2.0**-8 * (mixed.abs() + want.double().abs())
    err = (got.double() - want.double()).abs()
    assert (err <= bound).all(), f"{hc_mult=} {dtype=}: worst {float((err - bound).max())} over the bound"


def test_hc_kernels_refuse_bad_shapes_before_launch():
    layer, d = hc_layer(2, seed=1, dtype=torch.float32)
    streams = torch.randn(1, 3, 2, d)
    with pytest.raises(dt.InputError, match="4-D"):
        kernels.hc_pre(layer.attn_hc, streams[0], layer.input_layernorm)
    with pytest.raises(dt.InputError, match="hc_mult"):
        kernels.hc_pre(layer.attn_hc, torch.randn(1, 3, 4, d), layer.input_layernorm)
    with pytest.raises(dt.InputError, match="power of two"):
        kernels.hc_post(torch.rand(1, 3, 3), torch.rand(1, 3, 3, 3), torch.randn(1, 3, d), torch.randn(1, 3, 3, d))
    post, comb, _ = ref_hc_pre(layer.attn_hc, streams, layer.input_layernorm)
    with pytest.raises(dt.InputError, match="do not fit"):
        kernels.hc_post(post, comb, torch.randn(1, 3, d + 1), streams)
    with pytest.raises(dt.InputError, match="dtype"):
        kernels.hc_post(post, comb, torch.randn(1, 3, d).bfloat16(), streams)
