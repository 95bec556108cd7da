"""Triton kernels vs their torch references (interpreter on CPU; fp32, small shapes), the
indexer's tie rule (select_topk_table, shared by both backends), launcher input checks, and
whole-model equivalence with attention_backend="triton" against per-path HF runs.
Tensors and models live on the `device` fixture: cuda with DSV4_TREE_GPU=1 (tests/conftest.py)."""
import pytest
import torch

import dsv4_tree as dt
from cases import check_against_oracle, deep_chain_tree, prompt, random_tree, small_model
from dsv4_tree import kernels
from dsv4_tree.hf_bindings import apply_rotary_pos_emb
from dsv4_tree.reference import ops as ref
from dsv4_tree.attention.torch_ops import select_topk_table
from dsv4_tree.numerics.ties import TIE_MARGIN
from dsv4_tree.reference.sparse_decode import ref_indexer_gather_scores, ref_sparse_decode
from dsv4_tree.serving import KVPool

# fp32 on both sides; the kernels sum in tiles (online softmax), the references in one pass:
# rounding only, ~1e-6 relative. 1e-4 is far below what a wrong key or mask would cause.
TOL = dict(rtol=1e-4, atol=1e-5)


def fp32_pool(rows: torch.Tensor, rope_dim: int = 0, page_size: int = 16) -> KVPool:
    """An exact ("auto") fp32 pool whose slot i holds rows[i]."""
    pool = KVPool(rows.shape[0], rows.shape[1], rope_dim, "auto", page_size, rows.device, torch.float32)
    pool.write(torch.arange(rows.shape[0], device=rows.device), rows)
    return pool


def attention_case(t, h, d, m, k, g, k2, seed, device, shared=0):
    """sparse_decode arguments over two fp32 pools: a main pool of m rows with per-row index
    lists [t, k] (-1 holes, ragged lengths), an extra pool of g rows with lists [t, k2]; with
    `shared`, every row's extra list starts with the same `shared` slots (C128 committed entries,
    which every row sees)."""
    gen = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    def idx(k, size, lead=0):
        i = torch.randint(0, max(size, 1), (t, k), generator=gen, dtype=torch.int32)
        i[torch.rand(t, k, generator=gen) < 0.3] = -1
        i[:, :lead] = torch.arange(lead, dtype=torch.int32)
        lengths = torch.randint(lead, k + 1, (t,), generator=gen, dtype=torch.int32)
        return i.to(device), lengths.to(device)

    main, extra = fp32_pool(r(max(m, 1), d)), fp32_pool(r(max(g, 1), d))
    mi, ml = idx(k, m)
    xi, xl = idx(k2, g, shared)
    return dict(q=r(t, h, d), kv=main, indices=mi, lengths=ml, sinks=r(h), scale=d ** -0.5,
                extra_kv=extra, extra_indices=xi, extra_lengths=xl)


@pytest.mark.parametrize(
    "t,h,d,m,k,g,k2,shared",
    [(3, 4, 32, 20, 9, 1, 0, 0), (5, 4, 32, 12, 8, 37, 37, 37), (4, 8, 16, 10, 8, 50, 5, 0), (1, 2, 8, 3, 0, 3, 3, 3),
     (7, 16, 64, 30, 17, 64, 20, 8), (6, 20, 24, 40, 33, 9, 4, 0)],
)
def test_sparse_decode_matches_reference(t, h, d, m, k, g, k2, shared, device):
    # covers: main list only, keys every row sees (shared), both pools, a zero-width main list,
    # several key tiles (k > 16), two head blocks (h = 20 > 16) and a head_dim that is no power of 2
    args = attention_case(t, h, d, m, k, g, k2, seed=t * 100 + h, device=device, shared=shared)
    want_out, want_lse = ref_sparse_decode(**args)
    got_out, got_lse = kernels.sparse_decode(**args)
    case = f"{t=} {h=} {d=} {m=} {k=} {g=} {k2=} {shared=}"
    assert torch.allclose(got_out, want_out, **TOL), case
    assert torch.equal(torch.isinf(got_lse), torch.isinf(want_lse)), case
    fin = torch.isfinite(want_lse)
    assert fin.any(), case  # the case attends somewhere
    assert torch.allclose(got_lse[fin], want_lse[fin], **TOL), case


def test_row_with_only_the_sink_outputs_zero(device):
    # index lists full of -1 (with lengths covering them): only the sink remains
    args = attention_case(2, 4, 16, 5, 3, 4, 2, seed=1, device=device)
    args["indices"][:] = -1
    args["extra_indices"][:] = -1
    args["lengths"][:] = 3
    args["extra_lengths"][:] = 2
    for out, lse in (kernels.sparse_decode(**args), ref_sparse_decode(**args)):
        assert torch.equal(out, torch.zeros_like(out))
        # FlashMLA's convention: lse of the real keys only, +inf when there is none
        assert torch.equal(lse, torch.full_like(lse, float("inf")))


def indexer_case(t, h, d, c, e, v, seed, device):
    """Indexer scores over a per-row candidate table laid out like a real plan: committed entries
    0..c-1 (every row), then the row's own branch entries c..c+e-1 in block order, -1 padding."""
    gen = torch.Generator().manual_seed(seed)
    q, w = torch.randn(t, h, d, generator=gen), torch.randn(t, h, generator=gen)
    keys = fp32_pool(torch.randn(c + e, d, generator=gen).to(device))
    cand = torch.full((t, c + v), -1, dtype=torch.int32)
    cand[:, :c] = torch.arange(c, dtype=torch.int32)
    for i in range(t):
        picks = torch.randperm(e, generator=gen)[: int(torch.randint(0, min(e, v) + 1, (1,), generator=gen))]
        cand[i, c : c + picks.numel()] = c + picks.sort().values.to(torch.int32)
    return q.to(device), w.to(device), keys, cand.to(device)


@pytest.mark.parametrize("t,h,d,c,e,v,topk", [(4, 8, 16, 30, 3, 4, 5), (6, 4, 16, 3, 0, 2, 8), (2, 8, 16, 0, 4, 3, 2)])
def test_indexer_matches_reference(t, h, d, c, e, v, topk, device):
    q, w, keys, cand = indexer_case(t, h, d, c, e, v, seed=t + c, device=device)
    want_scores = ref_indexer_gather_scores(q, w, keys, cand, 0.25)
    scores = kernels.indexer_gather_scores(q, w, keys, cand, 0.25)
    assert torch.allclose(scores, want_scores, **TOL)
    got = select_topk_table(scores, cand, topk)
    want = select_topk_table(want_scores, cand, topk)
    assert not want[2].any(), "generated case has a boundary tie"
    assert got[0].device.type == got[1].device.type == got[2].device.type == device.type
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    assert torch.equal(got[0].sort(dim=1).values, want[0].sort(dim=1).values)


def test_tie_rule_prefers_earlier_blocks(device):
    # scores all exactly zero (relu of negative dots): the earliest candidates (block order) win
    q, w = -torch.ones(2, 2, 4, device=device), torch.ones(2, 2, device=device)
    keys = fp32_pool(torch.ones(6, 4, device=device))
    cand = torch.tensor([[0, 1, 2, 3, 4, 5], [5, 3, 1, 0, -1, -1]], dtype=torch.int32, device=device)
    for fn in (ref_indexer_gather_scores, kernels.indexer_gather_scores):
        scores = fn(q, w, keys, cand, 1.0)
        sel, lengths, ties = select_topk_table(scores, cand, 3)
        assert sel.tolist() == [[0, 1, 2], [5, 3, 1]], fn.__name__
        assert lengths.tolist() == [3, 3] and ties.tolist() == [1, 1], fn.__name__
        assert sel.device.type == device.type


def test_select_topk_table_rule():
    inf = float("-inf")
    cand = torch.tensor([[10, 11, 12, 13], [20, 21, 22, 23], [30, 31, -1, -1], [40, 41, 42, 43]])
    scores = torch.tensor([
        [3.0, 1.0, 3.0, 3.0],  # three equal scores across the boundary (k = 2): earlier columns win, a tie
        [4.0, 3.0, 2.0, 1.0],  # clear gap at the boundary: no tie
        [2.0, 5.0, inf, inf],  # two candidates only: -1 padding, nothing below the boundary to tie with
        [3.0, 2.0, 2.0 * (1 - TIE_MARGIN / 2), 0.0],  # boundary gap within TIE_MARGIN relative: a near-tie
    ])
    sel, lengths, ties = select_topk_table(scores, cand, 2)
    assert sel.tolist() == [[10, 12], [20, 21], [31, 30], [40, 41]]
    assert lengths.tolist() == [2, 2, 2, 2] and ties.tolist() == [1, 0, 0, 1]  # counted per row
    sel, lengths, ties = select_topk_table(scores, cand, 3)
    assert sel.tolist() == [[10, 12, 13], [20, 21, 22], [31, 30, -1], [40, 41, 42]]
    assert lengths.tolist() == [3, 3, 2, 3] and ties.tolist() == [0, 0, 0, 0]
    # every equal score: block order decides; k beyond the table: all candidates, -1 where none
    flat = torch.zeros(2, 4)
    flat[1, 3] = inf
    sel, lengths, ties = select_topk_table(flat, cand[:2], 6)
    assert sel.tolist() == [[10, 11, 12, 13], [20, 21, 22, -1]]
    assert lengths.tolist() == [4, 3] and ties.tolist() == [0, 0]
    sel, lengths, ties = select_topk_table(flat, cand[:2], 1)
    assert sel.tolist() == [[10], [20]] and ties.tolist() == [1, 1]
    # a gap just above TIE_MARGIN is no tie
    sel, _, ties = select_topk_table(torch.tensor([[1.0, 1.0 - 2 * TIE_MARGIN]]), cand[:1, :2], 1)
    assert sel.tolist() == [[10]] and ties.tolist() == [0]


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
    args = attention_case(2, 4, 16, 5, 3, 4, 2, seed=2, device=device)
    with pytest.raises(dt.InputError, match="3-D"):
        kernels.sparse_decode(**{**args, "q": args["q"][0]})
    with pytest.raises(dt.InputError, match="dtype"):
        kernels.sparse_decode(**{**args, "q": args["q"].double()})
    with pytest.raises(dt.InputError, match="head_dim"):
        kernels.sparse_decode(**{**args, "kv": fp32_pool(torch.randn(5, 8, device=device))})
    with pytest.raises(dt.InputError, match="rows"):
        kernels.sparse_decode(**{**args, "indices": args["indices"][:1]})
    q = args["q"]
    keys = fp32_pool(torch.randn(16, 16, device=device))
    cand = torch.zeros(2, 3, dtype=torch.int32, device=device)
    w = torch.ones(2, 4, device=device)
    kernels.indexer_gather_scores(q, w, keys, cand, 1.0)  # the well-formed call runs
    with pytest.raises(dt.InputError, match="contiguous"):
        kernels.indexer_gather_scores(q.transpose(0, 1).contiguous().transpose(0, 1), w, keys, cand, 1.0)
    with pytest.raises(dt.InputError, match="head_dim"):
        kernels.indexer_gather_scores(q, w, fp32_pool(torch.randn(16, 6, device=device)), cand, 1.0)
    with pytest.raises(dt.InputError, match="rows"):
        kernels.indexer_gather_scores(q, w, keys, cand[:1], 1.0)


# the chain case is slow (nightly, docs/testing.md): a chain is a tree whose every node has one
# child; the 24-node tree case, which also crosses C4 blocks on several paths, stays in every run
@pytest.mark.parametrize("kind", [pytest.param("chain", marks=pytest.mark.slow), "tree"])
def test_whole_model_triton_backend_matches_per_path(kind, device):
    model = small_model(device=device.type)
    eng = dt.Engine(model, dt.SpecConfig(eagle_topk=4, num_steps=8, num_draft_tokens=24, attention_backend="triton"))
    p = prompt(19, 5)
    tree = deep_chain_tree(int(p[-1]), 8, 3) if kind == "chain" else random_tree(int(p[-1]), 24, 7, 3, 4)
    check_against_oracle(model, eng, [p], [tree], f"triton {kind}")



@pytest.mark.gpu
def test_gpu_bf16_large_shapes(device):
    gen = torch.Generator().manual_seed(7)
    t, h, d, rope = 64, 64, 512, 64

    rows_max = []

    def bf16_pool(n):
        pool = KVPool(n, d, rope, "bfloat16", 64, device, torch.float32)
        rows = torch.randn(n, d, generator=gen)
        rows_max.append(float(rows.abs().max()))
        pool.write(torch.arange(n, device=device), rows.to(device))
        return pool

    def table(k, size):
        i = torch.randint(0, size, (t, k), generator=gen, dtype=torch.int32)
        i[torch.rand(t, k, generator=gen) < 0.3] = -1
        return i.to(device), torch.full((t,), k, dtype=torch.int32, device=device)

    main, extra = bf16_pool(1664), bf16_pool(16384)
    (mi, ml), (xi, xl) = table(640, main.num_slots), table(512, extra.num_slots)
    xi[:, :256] = torch.arange(256, dtype=torch.int32, device=device)  # C128 entries every row sees
    q = torch.randn(t, h, d, generator=gen).to(device, torch.bfloat16)
    args = dict(kv=main, indices=mi, lengths=ml, sinks=torch.randn(h, generator=gen).to(device), scale=d ** -0.5,
                extra_kv=extra, extra_indices=xi, extra_lengths=xl)
    want, _ = ref_sparse_decode(q.float(), **args)
    got, _ = kernels.sparse_decode(q, **args)
    assert got.dtype == torch.bfloat16
    # bf16 inputs upcast exactly, fp32 accumulation: one round-to-nearest cast of the output to
    # bf16 (2^-8 relative, design_notes/tolerances.md) plus the fp32 summation-order error of a
    # softmax-weighted sum over K = 640 + 512 keys, first order (K + 3) * eps32 * max|v| (the
    # weights sum to 1, so sum p_i |v_i| <= max |v|)
    k = mi.shape[1] + xi.shape[1]
    bound = 2 ** -8 * want.abs() + (k + 3) * torch.finfo(torch.float32).eps * max(rows_max)
    excess = float(((got.float() - want).abs() - bound).max())
    assert excess <= 0, f"sparse_decode bf16 error exceeds one output rounding by {excess:.2e}"
    q = torch.randn(64, 64, 128, device=device, dtype=torch.bfloat16)
    keys = torch.randn(65536, 128, device=device, dtype=torch.bfloat16)
    w = torch.randn(64, 64, device=device)
    cand = torch.arange(65536, dtype=torch.int32, device=device).expand(64, -1).contiguous()

    def pool_of(rows):
        pool = KVPool(rows.shape[0], 128, 0, "bfloat16", 64, device, torch.float32, kind="index_key")
        pool.write(torch.arange(rows.shape[0], device=device), rows)
        return pool

    got = kernels.indexer_gather_scores(q, w, pool_of(keys), cand, 128 ** -0.5)
    want = ref_indexer_gather_scores(q.float(), w, pool_of(keys), cand, 128 ** -0.5)
    # Both sides see the same bf16 values and their products are exact in fp32: only the fp32
    # summation order differs. First-order worst case: (D + H + 3 roundings) * eps32 times the
    # sum of |terms|, which is the score of |q|, |w|, |keys| (relu of a non-negative dot is itself).
    mag = ref_indexer_gather_scores(q.float().abs(), w.abs(), pool_of(keys.abs()), cand, 128 ** -0.5)
    bound = (128 + 64 + 3) * torch.finfo(torch.float32).eps * mag
    worst = float(((got - want).abs() / bound.clamp(min=1e-30)).max())
    assert ((got - want).abs() <= bound).all(), f"indexer score error {worst:.2f} x the summation bound"
