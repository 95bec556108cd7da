"""Triton kernels vs their torch references (interpreter on CPU; fp32, small shapes),
and whole-model equivalence with attention_backend="triton" against per-path HF runs.
Tensors and models live on the `device` fixture: cuda with DSV4_TREE_GPU=1 (tests/conftest.py)."""
import pytest
import torch

import dsv4_tree as dt
from cases import check_against_oracle, deep_chain_tree, prompt, random_tree, small_model
from dsv4_tree import kernels
from dsv4_tree.model.hf_bindings import apply_rotary_pos_emb
from dsv4_tree.reference import ops as ref

# fp32 on both sides; the kernels sum in tiles (online softmax), the references in one pass:
# rounding only, ~1e-6 relative. 1e-4 is far below what a wrong key or mask would cause.
TOL = dict(rtol=1e-4, atol=1e-5)


def attention_case(n, h, d, s, m, k1, g, k2, seed, device):
    gen = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    def idx(rows, k, size):
        i = torch.randint(0, max(size, 1), (rows, k), generator=gen)
        i[torch.rand(rows, k, generator=gen) < 0.3] = -1
        if size == 0:
            i[:] = -1
        return i.to(device)

    return (r(n, h, d), r(s, d), r(m, d), idx(n, k1, m), r(g, d), idx(n, k2, g), r(h), d ** -0.5)


@pytest.mark.parametrize(
    "n,h,d,s,m,k1,g,k2",
    [(3, 4, 32, 0, 20, 9, 0, 0), (5, 4, 32, 37, 12, 8, 0, 0), (4, 8, 16, 0, 10, 8, 50, 5), (1, 2, 8, 3, 0, 0, 0, 0),
     (7, 16, 64, 40, 30, 17, 64, 20)],
)
def test_sparse_mqa_sink_matches_reference(n, h, d, s, m, k1, g, k2, device):
    args = attention_case(n, h, d, s, m, k1, g, k2, seed=n * 100 + h, device=device)
    want_out, want_lse = ref.ref_sparse_mqa_sink(*args)
    got_out, got_lse = kernels.sparse_mqa_sink(*args)
    assert torch.allclose(got_out, want_out, **TOL), f"{n=} {h=} {d=} {s=} {m=} {k1=} {g=} {k2=}"
    assert torch.allclose(got_lse, want_lse, **TOL)


def test_row_with_only_the_sink_outputs_zero(device):
    q, shared, local, li, glob, gi, sinks, scale = attention_case(2, 4, 16, 0, 5, 3, 0, 0, seed=1, device=device)
    li[:] = -1
    out, lse = kernels.sparse_mqa_sink(q, shared, local, li, glob, gi, sinks, scale)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.allclose(lse, sinks.view(1, -1).expand(2, -1))


@pytest.mark.parametrize("n,h,d,c,e,v,topk", [(4, 8, 16, 30, 3, 4, 5), (6, 4, 16, 3, 0, 2, 8), (2, 8, 16, 0, 4, 3, 2)])
def test_indexer_matches_reference(n, h, d, c, e, v, topk, device):
    gen = torch.Generator().manual_seed(n + c)
    q, w = torch.randn(n, h, d, generator=gen), torch.randn(n, h, generator=gen)
    ck, bk = torch.randn(c, d, generator=gen), torch.randn(e, d, generator=gen)
    vis = torch.full((n, v), -1)  # distinct entries per row, in block order, like a real plan
    for i in range(n):
        picks = torch.randperm(e, generator=gen)[: int(torch.randint(0, min(e, v) + 1, (1,), generator=gen))]
        vis[i, : picks.numel()] = picks.sort().values
    scores = kernels.indexer_scores(q.to(device), w.to(device), ck.to(device), 0.25).cpu()
    assert torch.allclose(scores, ref.indexer_scores(q, w, ck, 0.25), **TOL)
    got = kernels.indexer_topk(q.to(device), w.to(device), ck.to(device), bk.to(device), vis.to(device), topk, 0.25)
    want = ref.ref_indexer_topk(q, w, ck, bk, vis, topk, 0.25)
    assert not want[2].any(), "generated case has a boundary tie"
    assert got[0].device.type == got[1].device.type == got[2].device.type == device.type
    valid = want[1]
    assert torch.equal(got[1].cpu(), valid)
    assert torch.equal(got[0].cpu()[valid].sort().values, want[0][valid].sort().values)


def test_tie_rule_prefers_earlier_blocks(device):
    # two rows whose scores are all exactly zero (relu of negative dots): earliest blocks win
    q = -torch.ones(2, 2, 4)
    keys = torch.ones(6, 4)
    sel, valid, ties = ref.ref_indexer_topk(q, torch.ones(2, 2), keys, keys[:0], torch.full((2, 1), -1), 3, 1.0)
    assert sel.tolist() == [[0, 1, 2], [0, 1, 2]] and ties.tolist() == [True, True] and valid.all()
    ksel, _, kties = kernels.indexer_topk(q.to(device), torch.ones(2, 2, device=device), keys.to(device),
                                          keys[:0].to(device), torch.full((2, 1), -1, device=device), 3, 1.0)
    assert ksel.cpu().tolist() == sel.tolist() and kties.cpu().tolist() == ties.tolist()


def test_pool_entries_matches_reference(device):
    model = small_model(device=device.type)
    comp = model.hf.model.layers[1].self_attn.compressor
    gen = torch.Generator().manual_seed(3)
    kv = torch.randn(5, 8, 32, generator=gen)
    gate = torch.randn(5, 8, 32, generator=gen)
    gate[:, :4][torch.rand(5, 4, 32, generator=gen) < 0.5] = float("-inf")  # null rows of block -1
    kv, gate, pos = kv.to(device), gate.to(device), torch.tensor([[0, 4, 8, 12, 16]], device=device)
    cos, sin = model.hf.model.rotary_emb(kv, position_ids=pos, layer_type="compress")
    want = ref.ref_pool_entries(kv, gate, comp.kv_norm, cos, sin, apply_rotary_pos_emb)
    got = kernels.pool_entries(kv, gate, comp.kv_norm, cos, sin, apply_rotary_pos_emb)
    assert torch.allclose(got, want, **TOL)


def test_launchers_check_inputs(device):
    q, shared, local, li, glob, gi, sinks, scale = attention_case(2, 4, 16, 3, 5, 3, 0, 0, seed=2, device=device)
    with pytest.raises(dt.InputError, match="3-D"):
        kernels.sparse_mqa_sink(q[0], shared, local, li, glob, gi, sinks, scale)
    with pytest.raises(dt.InputError, match="dtype"):
        kernels.sparse_mqa_sink(q.double(), shared, local, li, glob, gi, sinks, scale)
    with pytest.raises(ValueError, match="width"):
        kernels.sparse_mqa_sink(q, shared[:, :8].contiguous(), local, li, glob, gi, sinks, scale)
    with pytest.raises(dt.InputError, match="contiguous"):
        kernels.indexer_scores(q, torch.ones(2, 4, device=device), torch.randn(16, 6, device=device).t(), 1.0)
    with pytest.raises(ValueError, match="rows"):
        kernels.sparse_mqa_sink(q, shared, local, li[:1], glob, gi, sinks, scale)


@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_whole_model_triton_backend_matches_per_path(kind, device):
    model = small_model(device=device.type)
    eng = dt.Engine(model, dt.SpecConfig(eagle_topk=4, num_steps=8, num_draft_tokens=24, attention_backend="triton"))
    p = prompt(19, 5)
    tree = deep_chain_tree(int(p[-1]), 8, 3) if kind == "chain" else random_tree(int(p[-1]), 24, 7, 3, 4)
    check_against_oracle(model, eng, [p], [tree], f"triton {kind}")


@pytest.mark.gpu
def test_gpu_bf16_large_shapes(device):
    args = attention_case(64, 64, 512, 1024, 640, 640, 16384, 512, seed=7, device=device)
    bf = [a.to(torch.bfloat16) if torch.is_tensor(a) and a.is_floating_point() else a for a in args]
    want, _ = ref.ref_sparse_mqa_sink(*[a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in bf])
    got, _ = kernels.sparse_mqa_sink(*bf)
    # bf16 inputs, fp32 accumulation: output rounding to bf16 dominates (2^-8 relative)
    assert torch.allclose(got.float(), want, rtol=2e-2, atol=2e-2)
    q = torch.randn(64, 64, 128, device=device, dtype=torch.bfloat16)
    keys = torch.randn(65536, 128, device=device, dtype=torch.bfloat16)
    w = torch.randn(64, 64, device=device)
    got = kernels.indexer_scores(q, w, keys, 128 ** -0.5)
    want = ref.indexer_scores(q.float(), w, keys.float(), 128 ** -0.5)
    # Both sides see the same bf16 values and their products are exact in fp32: only the fp32
    # summation order differs. First-order worst case: (D + H + 3 roundings) * eps32 times the
    # sum of |terms|, which is the score of |q|, |w|, |keys| (relu of a non-negative dot is itself).
    mag = ref.indexer_scores(q.float().abs(), w.abs(), keys.float().abs(), 128 ** -0.5)
    bound = (128 + 64 + 3) * torch.finfo(torch.float32).eps * mag
    worst = float(((got - want).abs() / bound.clamp(min=1e-30)).max())
    assert ((got - want).abs() <= bound).all(), f"indexer score error {worst:.2f} x the summation bound"
