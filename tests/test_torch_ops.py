"""The torch backend's batched hot spots (attention/torch_ops.py) equal the clear per-row
references (reference/) on generated cases; the tie rule bit for bit."""
import pytest
import torch

from cases import small_model
from dsv4_tree.attention import torch_ops
from dsv4_tree.hf_bindings import apply_rotary_pos_emb
from dsv4_tree.reference import (ref_indexer_gather_scores, ref_pool_entries, ref_select_topk, ref_sparse_decode,
                                 ref_sparse_mqa_sink)
from test_sparse_decode import CASES, DEV, assert_close, decode_case, filled_pool, index_table

# Same fp32 math on the same values, batched against per row: summation order only (~1e-7 of the
# largest magnitude); 1e-5 of max|expected| (test_sparse_decode.REL) is far below a wrong key,
# length or sink (>1e-2).


@pytest.mark.parametrize("kv_dtype,page_size,extra", CASES)
def test_sparse_decode(kv_dtype, page_size, extra):
    args = decode_case(kv_dtype, page_size, extra, seed=3 * page_size + extra)
    (got, got_lse), (want, want_lse) = torch_ops.sparse_decode(**args), ref_sparse_decode(**args)
    assert_close(got, want, f"{kv_dtype=} {page_size=} {extra=}")
    assert_close(got_lse, want_lse, f"{kv_dtype=} {page_size=} {extra=}")


@pytest.mark.parametrize("kv_dtype,kind", [("auto", "kv"), ("fp8_e4m3", "kv"), ("fp8_e4m3", "index_key")])
def test_indexer_gather_scores(kv_dtype, kind):
    gen = torch.Generator().manual_seed(11)
    d, rope = (64, 16) if kind == "kv" else (160, 0)
    keys = filled_pool(gen, 71, d, rope, kv_dtype, 16, kind)
    cand, _ = index_table(gen, 6, 45, keys.num_slots)
    q, w = torch.randn(6, 5, d, generator=gen).to(DEV), torch.randn(6, 5, generator=gen).to(DEV)
    got = torch_ops.indexer_gather_scores(q, w, keys, cand, d ** -0.5, chunk=16)  # several chunks
    assert_close(got, ref_indexer_gather_scores(q, w, keys, cand, d ** -0.5), f"{kv_dtype=} {kind=}")


def test_select_topk_table_is_the_tie_rule():
    gen = torch.Generator().manual_seed(5)
    for trial in range(40):
        t, c, k = 1 + trial % 5, 1 + trial % 13, 1 + trial % 7
        scores = torch.randint(0, 4, (t, c), generator=gen).float()  # few values: many exact ties
        scores[torch.rand(t, c, generator=gen) < 0.2] = float("-inf")
        scores[0] += torch.rand(c, generator=gen) * 1e-5 * (trial % 2)  # near ties too
        cand = torch.randint(0, 100, (t, c), generator=gen)
        got, want = torch_ops.select_topk_table(scores, cand, k), ref_select_topk(scores, cand, k)
        for name, a, b in zip(("selected", "lengths", "ties"), got, want):
            assert torch.equal(a, b), f"{trial=} {name}: {a.tolist()} vs {b.tolist()} ({scores.tolist()})"


def test_sparse_mqa_sink():
    gen = torch.Generator().manual_seed(23)
    t, h, d = 5, 4, 32
    q, sinks = torch.randn(t, h, d, generator=gen), torch.randn(h, generator=gen)
    shared, local, glob = (torch.randn(n, d, generator=gen) for n in (6, 12, 20))
    li, gi = torch.randint(0, 12, (t, 7), generator=gen), torch.randint(0, 20, (t, 5), generator=gen)
    li[torch.rand(t, 7, generator=gen) < 0.3] = -1
    gi[torch.rand(t, 5, generator=gen) < 0.3] = -1
    for s in (shared, shared[:0]):
        (got, got_lse) = torch_ops.sparse_mqa_sink(q, s, local, li, glob, gi, sinks, d ** -0.5)
        (want, want_lse) = ref_sparse_mqa_sink(q, s, local, li, glob, gi, sinks, d ** -0.5)
        assert_close(got, want, f"shared={s.shape[0]}")
        assert_close(got_lse, want_lse, f"shared={s.shape[0]}")


def test_pool_entries():
    comp = small_model().hf.model.layers[1].self_attn.compressor
    gen = torch.Generator().manual_seed(3)
    kv, gate = torch.randn(5, 8, 32, generator=gen), torch.randn(5, 8, 32, generator=gen)
    gate[:, :4][torch.rand(5, 4, 32, generator=gen) < 0.5] = float("-inf")
    cos, sin = small_model().hf.model.rotary_emb(kv, position_ids=torch.tensor([[0, 4, 8, 12, 16]]),
                                                 layer_type="compress")
    got = torch_ops.pool_entries(kv, gate, comp.kv_norm, cos, sin, apply_rotary_pos_emb)
    assert_close(got, ref_pool_entries(kv, gate, comp.kv_norm, cos, sin, apply_rotary_pos_emb), "pool_entries")
