"""A tree verify batch padded by SGLang 0.5.23's DP attention (`ForwardBatch._pad_inputs_to_size`
pads the requests to the DP width: `req_pool_indices` 0, SGLang's padding row of `req_to_token`,
which it allocates as zeros and never hands out; `seq_lens` 1; `out_cache_loc` 0 for every verify
row; the verify input's tree, `spec_info.retrieve_next_token` / `retrieve_next_sibling`, is not
padded). The tree backend's metadata of the padded batch equals the unpadded batch's on the real
rows and gives the padding rows SGLang's own (chain) verify rows; on real pools the padded verify's
writes differ from the unpadded verify's only in what SGLang's padding row owns, and the C4
indexer selects the same entries for every real row."""
import pytest
import torch
from sglang.srt.layers.attention import deepseek_v4_backend as dsv4

from dsv4_tree.attention.backend import get_backend
from dsv4_tree.errors import StateError
from dsv4_tree.sglang_plugin import install_move_kv_cache
from dsv4_tree.sglang_plugin.backend import TreeDeepseekV4AttnBackend
from dsv4_tree.sglang_plugin.metadata import tree_verify_metadata
from plugin_probe import dsv4_dir
from sgl_cases import CORE_FIELDS, INDEXER_FIELDS, StandIn, layout, same, sglang_tree
from sgl_pool import published_context, snapshot
from sgl_round import Case, NodeInputs, differing, unchanged, verify_writes, window_mask
from test_sglang_chain import sglang_linear
from test_sglang_tree_indexer import IndexerStandIn, backend_on, run_indexer, valid_index_keys

N_MAX = 10


@pytest.fixture(scope="module")
def context(tmp_path_factory):
    with published_context(dsv4_dir(str(tmp_path_factory.mktemp("models"))), N_MAX):
        install_move_kv_cache()
        yield


def padded(rpi, seq_lens, out_loc, pad: int, n: int):
    """SGLang's DP padding of a verify batch by `pad` requests."""
    i32 = dict(dtype=torch.int32)
    return (torch.cat([rpi, torch.zeros(pad, **i32)]), torch.cat([seq_lens, torch.ones(pad, **i32)]),
            torch.cat([out_loc, torch.zeros(pad * n, dtype=out_loc.dtype)]))


def raw(rpi, seq_lens, out_loc):
    return dsv4.DSV4RawVerifyMetadata(req_pool_indices=rpi, seq_lens=seq_lens, out_cache_loc=out_loc)


def rows_equal(a, b, rows: int, label: str) -> None:
    """Per-row tensors agree on their first `rows` rows; anything else agrees whole."""
    if isinstance(a, torch.Tensor) and a.dim() and a.shape[0] != (b.shape[0] if isinstance(b, torch.Tensor) else -1):
        a, b = a[:rows], b[:rows]
    assert same(a, b), label


@pytest.mark.parametrize("pad", [1, 3])
def test_padded_tables_equal_unpadded_on_real_rows(no_flashmla_schedule, pad):
    gen = torch.Generator().manual_seed(31 + pad)
    lens, topk, steps, n = [300, 700], 4, 3, 8  # the reported case: [1, 2] -> [1, 2, 0], 16 -> 24 slots
    bs = len(lens)
    req_to_token, mapping = layout(lens, n, gen)
    req_to_token[0] = 0  # SGLang's padding row: zeros from allocation (slot 0, page 0, no request's)
    sb = StandIn(req_to_token, mapping, n)
    rpi, seq_lens = torch.tensor([1, 2], dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)
    out_loc = torch.cat([req_to_token[r, p:p + n] for r, p in zip(rpi.tolist(), lens)]).to(torch.int64)
    _, rn, rs = sglang_tree(bs, topk, steps, n, seq_lens, gen)
    prpi, pseq, ploc = padded(rpi, seq_lens, out_loc, pad, n)
    want = tree_verify_metadata(sb, raw(rpi, seq_lens, out_loc), rn, rs)
    got = tree_verify_metadata(sb, raw(prpi, pseq, ploc), rn, rs)  # the tree stays [bs, N]
    t = bs * n
    label = f"{pad=} {lens=} {topk=} {steps=} {n=}"
    assert got.core_attn_metadata.positions_casual.shape[0] == (bs + pad) * n, label
    for f in CORE_FIELDS:
        rows_equal(getattr(got.core_attn_metadata, f), getattr(want.core_attn_metadata, f), t, f"{label} {f}")
    for f in INDEXER_FIELDS:
        rows_equal(getattr(got.indexer_metadata, f), getattr(want.indexer_metadata, f), t, f"{label} {f}")
        rows_equal(getattr(got.branch_indexer, f), getattr(want.branch_indexer, f), t, f"{label} branch {f}")
    for f in want.tree.__dataclass_fields__:
        a, b = getattr(got.tree, f), getattr(want.tree, f)
        if f in ("c4_closing", "c128_closing"):  # ascending row ids: the padding rows' come last
            assert same(a[a < t], b), f"{label} tree.{f}"
            continue
        rows_equal(a, b, bs if f in ("parents", "depth", "ancestors") else t, f"{label} tree.{f}")
    assert torch.equal(got.tree.depth[bs:], torch.arange(n).expand(pad, n)), label  # chains
    # the padding rows are SGLang's own verify rows for the padded requests (its chain layout)
    ref_core, ref_idx = sglang_linear(sb, prpi, pseq, ploc, n)
    for f in CORE_FIELDS:
        a, b = getattr(got.core_attn_metadata, f), getattr(ref_core, f)
        if isinstance(a, torch.Tensor) and a.dim():
            assert same(a[t:], b[t:]), f"{label} padding rows {f}"
    for f in ("page_table", "compressed_seq_lens"):
        assert same(getattr(got.indexer_metadata, f)[t:], getattr(ref_idx, f)[t:]), f"{label} padding rows {f}"
    # inert: the padding rows write SGLang's dummy slot 0 (SWA and entries), no real request's slot
    tree = got.tree
    assert torch.equal(got.core_attn_metadata.raw_out_loc[t:], torch.zeros(pad * n, dtype=torch.int64)), label
    lens_all = tree.seq_lens_casual.to(torch.int64)
    for m, loc in ((4, tree.c4_out_loc), (128, tree.c128_out_loc)):
        closes = lens_all % m == 0
        pad_writes = set(loc[t:][closes[t:]].tolist())
        real = set((req_to_token[1:bs + 1].to(torch.int64) // m).view(-1).tolist()) | set(loc[:t][closes[:t]].tolist())
        assert pad_writes <= {0} and not pad_writes & real, f"{label} C{m} padding writes {pad_writes}"
        assert bool((loc[t:] == 0).all()), label
    assert bool((lens_all[t:] % 4 == 0).any()), label  # non-vacuous: padding rows close C4 blocks


def test_more_tree_rows_than_requests_is_refused(no_flashmla_schedule):
    gen = torch.Generator().manual_seed(4)
    lens, n = [300, 700], 8
    req_to_token, mapping = layout(lens, n, gen)
    sb = StandIn(req_to_token, mapping, n)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    _, rn, rs = sglang_tree(2, 4, 3, n, seq_lens, gen)
    loc = req_to_token[1, 300:300 + n].to(torch.int64)
    with pytest.raises(StateError, match=r"retrieve_next_token \(2, 8\).*at most the batch's 1"):
        tree_verify_metadata(sb, raw(torch.tensor([1], dtype=torch.int32), seq_lens[:1], loc), rn, rs)
    with pytest.raises(StateError, match=r"out_cache_loc \(8,\) must hold bs \* N = 2 \* 8 = 16"):
        tree_verify_metadata(sb, raw(torch.tensor([1, 2], dtype=torch.int32), seq_lens, loc), rn, rs)


def padded_round(case, gen, lens, topk, steps, n, pad):
    """The unpadded verify's writes on case.chain_pool and the padded one's on case.tree_pool (same
    node inputs for the real rows) -> (metadata unpadded, padded, inputs, rpi, seq_lens, tree)."""
    bs = len(lens)
    case.req_to_token[0] = 0  # SGLang's padding row
    rpi = torch.arange(1, bs + 1, dtype=torch.int32).flip(0)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    _, rn, rs = sglang_tree(bs, topk, steps, n, seq_lens, gen)
    inputs = NodeInputs.draw((bs + pad) * n, case.comps, gen)
    ops = get_backend("torch")
    _, want = verify_writes(case.chain_pool, case.req_to_token, case.mapping, rpi, seq_lens, rn, rs,
                            inputs.rows(torch.arange(bs * n)), case.comps, ops)
    prpi, pseq, _ = padded(rpi, seq_lens, torch.zeros(0, dtype=torch.int64), pad, n)
    out_loc, got = verify_writes(case.tree_pool, case.req_to_token, case.mapping, prpi, pseq, rn, rs, inputs,
                                 case.comps, ops)
    assert bool((out_loc[bs * n:] == 0).all())  # SGLang's zero padding of out_cache_loc
    return want, got, inputs, prpi, pseq


def test_padded_verify_writes_only_the_padding_rows_state(context, no_flashmla_schedule):
    gen = torch.Generator().manual_seed(17)
    lens, topk, steps, n, pad = [125, 381], 3, 3, 8, 2  # C4 and C128 blocks close in both windows
    case = Case(lens, gen, n)
    before = snapshot(case.tree_pool)
    padded_round(case, gen, lens, topk, steps, n, pad)
    with_pad, without = snapshot(case.tree_pool), snapshot(case.chain_pool)
    # what SGLang's padding row owns: its positions' SWA record and C4 state rows (slot 0), its C128
    # state rows (request 0's ring), the entry and indexer key of slot 0
    padding = window_mask(case.tree_pool, case.req_to_token, [(0, 0, 1 + n)], scratch=False)
    label = f"{lens=} {topk=} {steps=} {n=} {pad=}"
    assert differing(with_pad, without, padding) == {}, f"{label}: a padding row wrote a real request's state"
    # non-vacuous: the padding rows did write, in every kind of state the padding row owns
    wrote = differing(with_pad, without, unchanged(before))
    assert {"swa.0", "state.0", "index_state.0", "state.1", "c4.0", "index4.0"} <= set(wrote), f"{label}: {wrote}"
    trash = window_mask(case.chain_pool, case.req_to_token, [], scratch=False)  # the trash entry slot alone
    assert differing(with_pad, before, padding) == differing(without, before, trash), label


def test_padded_indexer_selects_the_same_entries_on_real_rows(context, no_flashmla_schedule):
    gen = torch.Generator().manual_seed(23)
    lens, topk, steps, n, pad = [2102, 2301], 3, 3, 8, 1  # more C4 blocks than index_topk: scores decide
    case = Case(lens, gen, N_MAX, max_len=4096)
    valid_index_keys(case, gen)
    want, got, inputs, prpi, pseq = padded_round(case, gen, lens, topk, steps, n, pad)
    t, tp = len(lens) * n, (len(lens) + pad) * n
    q = torch.randn(tp, 8, 128, generator=gen).to(torch.float8_e4m3fn)
    w = torch.rand(tp, 8, 1, generator=gen) + 0.1
    indexer = IndexerStandIn(next(c for c in case.comps if c.is_in_indexer), q, w)
    fwd = TreeDeepseekV4AttnBackend.forward_c4_indexer
    unpadded = run_indexer(fwd, backend_on(TreeDeepseekV4AttnBackend, case.chain_pool, case.req_to_token, want),
                           indexer, torch.arange(t))
    ours = run_indexer(fwd, backend_on(TreeDeepseekV4AttnBackend, case.tree_pool, case.req_to_token, got), indexer,
                       torch.arange(tp))
    assert torch.equal(ours[:t], unpadded)
    assert bool((unpadded >= 0).sum(1).eq(512).all())  # each real row selects index_topk of its > 512 blocks
    # the padding rows read only the C4 pool's page 0 (64 entries), the padding row's page, as
    # SGLang's own indexer on SGLang's own (chain) metadata of the padded batch does (which slot of
    # that page each picks differs: the zero row names slot 0 as every block's home, SGLang's page
    # table names slot b for block b; both are the dummy page, and the padding rows' output is dropped)
    ploc = torch.cat([case.req_to_token[r, p:p + n] for r, p in zip(prpi.tolist(), pseq.tolist())]).to(torch.int64)
    core, idx = sglang_linear(StandIn(case.req_to_token, case.mapping, n), prpi, pseq, ploc, n)
    sgl = run_indexer(dsv4.DeepseekV4AttnBackend.forward_c4_indexer,
                      backend_on(dsv4.DeepseekV4AttnBackend, case.tree_pool, case.req_to_token,
                                 dsv4.DSV4Metadata(core, idx)), indexer, torch.arange(tp))
    for label, out in (("ours", ours[t:]), ("sglang", sgl[t:])):
        sel = out[out >= 0]
        assert sel.numel() and bool((sel < 64).all()), (label, sel.unique().tolist())
