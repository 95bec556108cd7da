"""Our mHC weights (numerics/hc.py) against transformers' DeepseekV4HyperConnection: the same numbers
(to the last bit or two) with fewer ops. The module comparison runs the numpy Sinkhorn (CPU, no
autograd); the torch loop, which serves cuda, meta and autograd, is compared with the numpy
loop bitwise, and the autograd tests run it end to end."""
import pytest
import torch

from dsv4_tree.diagnostics import OpCounter
from dsv4_tree.numerics.hc import hc_collapse, hc_head, hc_weights, sinkhorn_numpy, sinkhorn_torch
from dsv4_tree.checkpoint.tiny import random_model, tiny_config


def hc_module(hc_mult: int, seed: int):
    torch.manual_seed(seed)
    hf = random_model(tiny_config(hc_mult=hc_mult))
    layer = hf.model.layers[1]
    with torch.no_grad():  # spread the gates so every weight matters
        for m in (layer.attn_hc, layer.ffn_hc):
            m.fn.normal_(0, 0.5)
            m.base.normal_(0, 1.0)
            m.scale.uniform_(0.5, 2.0)
    return hf, layer, hf.config.hidden_size


@pytest.mark.parametrize("hc_mult", [2, 4])
@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_weights_equal_the_module(hc_mult, rows, dtype):
    # same formulas in the same order; elementwise kernels (sigmoid) may take a vector or a
    # scalar path depending on a slice's layout, so the last bit of a value can differ
    hf, layer, d = hc_module(hc_mult, seed=rows + hc_mult)
    streams = torch.randn(1, rows, hc_mult, d).to(dtype)
    for module in (layer.attn_hc, layer.ffn_hc):
        with torch.no_grad():
            want = module(streams)
            got = hc_weights(module, streams)
            collapsed = hc_collapse(module, streams)
        for w, g, name in zip(want, got, ("post", "comb", "collapsed")):
            assert g.dtype == w.dtype and g.shape == w.shape, name
            tol = 1e-6 if g.dtype == torch.float32 else 2**-7  # bf16: one rounding of the output
            torch.testing.assert_close(g, w, rtol=tol, atol=tol * 1e-2, msg=name)
        torch.testing.assert_close(collapsed, want[2], rtol=1e-6 if dtype == torch.float32 else 2**-7, atol=0)


@pytest.mark.parametrize("hc_mult", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_head_equals_the_module_in_fewer_ops(hc_mult, dtype):
    hf, _, d = hc_module(hc_mult, seed=7 + hc_mult)
    head = hf.model.hc_head
    with torch.no_grad():
        head.hc_fn.normal_(0, 0.5)
        head.hc_base.normal_(0, 1.0)
    streams = torch.randn(1, 5, hc_mult, d).to(dtype)
    # counted in inference mode, as the engine runs (under no_grad the fused norm decomposes)
    with torch.inference_mode(), OpCounter() as theirs:
        want = head(streams)
    with torch.inference_mode(), OpCounter() as ours:
        got = hc_head(head, streams)
    assert got.dtype == want.dtype and got.shape == want.shape
    # the fused F.rms_norm against transformers' six-op norm: last-bit rounding (bf16: one output rounding)
    torch.testing.assert_close(got, want, rtol=1e-6 if dtype == torch.float32 else 2**-7, atol=0)
    assert ours.total < theirs.total, (ours.total, theirs.total)  # 11 vs 21 (fp32, torch 2.13)


def test_numpy_and_torch_sinkhorn_agree_and_the_loop_is_the_one_that_runs():
    comb = torch.softmax(torch.randn(3, 5, 4, 4), -1) + 1e-6
    assert torch.equal(sinkhorn_numpy(comb, 20, 1e-6), sinkhorn_torch(comb, 20, 1e-6))
    hf, layer, d = hc_module(4, seed=0)
    streams = torch.randn(1, 2, 4, d)
    with torch.no_grad(), OpCounter() as ours:
        hc_weights(layer.attn_hc, streams)
    with torch.no_grad(), OpCounter() as theirs:
        layer.attn_hc(streams)
    # the Sinkhorn loop alone is 6 ops per iteration in torch; ours runs it on the host
    assert ours.total < 40 < 6 * layer.attn_hc.hc_sinkhorn_iters < theirs.total, (ours.total, theirs.total)


def test_autograd_takes_the_torch_loop():
    hf, layer, d = hc_module(2, seed=1)
    streams = torch.randn(1, 3, 2, d, requires_grad=True)
    post, comb, collapsed = hc_weights(layer.attn_hc, streams)
    (comb.sum() + collapsed.sum() + post.sum()).backward()
    assert streams.grad is not None and torch.isfinite(streams.grad).all()


def test_autograd_after_an_inference_mode_forward():
    # the first call may come from the engine's forward (inference mode); what it caches must
    # still serve a later autograd call (the full suite caught the cached scale index)
    hf, layer, d = hc_module(3, seed=2)
    streams = torch.randn(1, 2, 3, d)
    with torch.inference_mode():
        hc_weights(layer.attn_hc, streams)
    x = streams.clone().requires_grad_(True)
    hc_weights(layer.attn_hc, x)[1].sum().backward()
    assert x.grad is not None
