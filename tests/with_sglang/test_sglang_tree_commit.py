"""The write side of tree verify on SGLang 0.5.23's own DeepSeekV4TokenToKVPool (built on the CPU):
tree verify writes -> accept with SGLang's verify_tree_greedy -> commit, against a linear verify
and commit of the accepted path by the same code. Compared bit for bit: every SWA record, C4 /
C128 entry, C4 indexer key and compressor state row outside the positions past the new length
(and the scratch slots); nothing outside the verify window changes. Trees come from SGLang's
draft pipeline; contexts cross C4 and C128 blocks and pages."""
import pytest
import torch

from dsv4_tree.attention.backend import get_backend
from dsv4_tree.sglang_plugin import commit as commit_mod
from dsv4_tree.sglang_plugin import install_move_kv_cache
from dsv4_tree.sglang_plugin.scratch import pool_layers
from plugin_probe import dsv4_dir
from sgl_cases import sglang_tree
from sgl_pool import published_context, snapshot
from sgl_round import (Case, NodeInputs, accepted_nodes, chain_round, commit, differing, greedy_accept,
                       random_targets, tree_ready, verify_writes, window_mask)

N_MAX = 10


@pytest.fixture(scope="module")
def context(tmp_path_factory):
    with published_context(dsv4_dir(str(tmp_path_factory.mktemp("models"))), N_MAX):
        install_move_kv_cache()
        yield


def one_round(case: Case, rpi, lens, topk, steps, n, gen, ops, last_child=False):
    """One round in tree mode on case.tree_pool and per request in chain mode on case.chain_pool;
    returns (accepted paths, before-round snapshot of the tree pool)."""
    bs = len(lens)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    _, rn, rs = sglang_tree(bs, topk, steps, n, seq_lens, gen)
    inputs = NodeInputs.draw(bs * n, case.comps, gen)
    before = snapshot(case.tree_pool)
    out_loc, meta = verify_writes(case.tree_pool, case.req_to_token, case.mapping, rpi, seq_lens, rn, rs, inputs,
                                  case.comps, ops)
    accept_index, accept_lens = greedy_accept(rn, rs, random_targets(rn, rs, gen, last_child), steps)
    commit(case.tree_pool, rpi, seq_lens, rn, rs, out_loc, accept_index, accept_lens)
    paths = accepted_nodes(accept_index, accept_lens, n)
    for b, path in enumerate(paths):
        chain_round(case.chain_pool, case.req_to_token, case.mapping, int(rpi[b]), lens[b],
                    inputs.rows(torch.tensor([b * n + a for a in path])), case.comps, ops)
    # C4 blocks closed at nodes other than the first at their depth: entries in scratch (the tree
    # indexer's branch candidates, test_sglang_tree_indexer.py)
    scratch_c4 = int((meta.tree.c4_out_loc >= case.tree_pool.dsv4_tree_scratch.start[4]).sum())
    return paths, before, inputs, rn, rs, scratch_c4


def check_round(case: Case, rpi, lens, paths, before, n, label):
    tree, chain = snapshot(case.tree_pool), snapshot(case.chain_pool)
    past = window_mask(case.tree_pool, case.req_to_token,
                       [(int(r), p + len(path), p + n) for r, p, path in zip(rpi, lens, paths)])
    assert differing(tree, chain, past) == {}, f"{label}: committed state differs from the chain run"
    window = window_mask(case.tree_pool, case.req_to_token, [(int(r), p, p + n) for r, p in zip(rpi, lens)])
    assert differing(tree, before, window) == {}, f"{label}: a write outside the verify window"


@pytest.mark.parametrize("ops", ["torch", "triton"])
def test_full_round_equals_the_chain_run_of_the_accepted_path(context, no_flashmla_schedule, ops):
    gen = torch.Generator().manual_seed(11)
    # C4 and C128 blocks close inside both windows (125 -> 128, 381 -> 384)
    lens, topk, steps, n = [125, 381], 3, 3, 8
    case = Case(lens, gen, n)
    rpi = torch.tensor([2, 1], dtype=torch.int32)  # row 3 is a request outside the batch
    paths, before, inputs, rn, rs, scratch_c4 = one_round(case, rpi, lens, topk, steps, n, gen, get_backend(ops),
                                                          last_child=True)
    label = f"{ops=} {lens=} {paths=}"
    assert any(a != d for path in paths for d, a in enumerate(path)), f"{label}: no sibling accepted"
    assert scratch_c4, f"{label}: no C4 entry closed at a non-first node"
    check_round(case, rpi, lens, paths, before, n, label)
    # non-vacuous: the committed SWA records are the accepted nodes' own records
    swa = pool_layers(case.tree_pool)[0].swa
    for b, path in enumerate(paths):
        slots = case.req_to_token[int(rpi[b]), lens[b]:lens[b] + len(path)].to(torch.int64)
        got = swa.read(case.tree_pool.translate_loc_from_full_to_swa(slots))
        want = inputs.swa[torch.tensor([b * n + a for a in path])]
        assert torch.equal(got, want), label
    # scratch lies past every slot SGLang's page tables can name
    scratch = case.tree_pool.dsv4_tree_scratch
    top_token = int(case.req_to_token.max())
    assert all(scratch.start[m] > top_token // m for m in (4, 128)), (scratch, top_token)


def test_rounds_in_a_row_cross_c4_and_c128_blocks(context, no_flashmla_schedule):
    gen = torch.Generator().manual_seed(23)
    lens, n = [121, 251], 8  # SGLang's window (speculative_num_draft_tokens) is fixed for a server
    case = Case(lens, gen, N_MAX)
    rpi = torch.tensor([1, 2], dtype=torch.int32)
    ops = get_backend("torch")
    scratch_rounds = 0
    for r, (topk, steps) in enumerate([(2, 3), (4, 2), (3, 3), (2, 4), (4, 3), (3, 2)]):
        paths, before, *_, scratch_c4 = one_round(case, rpi, lens, topk, steps, n, gen, ops)
        check_round(case, rpi, lens, paths, before, n, f"round {r} {topk=} {steps=} {lens=} {paths=}")
        lens = [p + len(path) for p, path in zip(lens, paths)]
        scratch_rounds += scratch_c4 > 0
    assert lens[0] > 128 and lens[1] > 256, lens  # the rounds crossed a C128 block in both requests
    assert scratch_rounds >= 3, scratch_rounds  # most rounds closed C4 blocks at non-first nodes


def test_rounds_in_a_row_at_the_ring_bound_with_the_triton_compressor(context, no_flashmla_schedule):
    """N = 10, SGLang's bound for its C4 state ring under speculation (16 rows per SWA page): the
    rows a window writes never alias a row the next block still reads, round after round; the
    branch compressor is the Triton kernel (interpreter)."""
    gen = torch.Generator().manual_seed(29)
    lens, n = [117, 247], N_MAX
    case = Case(lens, gen, n)
    rpi = torch.tensor([2, 1], dtype=torch.int32)
    ops = get_backend("triton")
    for r, (topk, steps) in enumerate([(3, 3), (2, 4), (4, 3), (3, 4)]):
        paths, before, *_ = one_round(case, rpi, lens, topk, steps, n, gen, ops, last_child=r % 2 == 0)
        check_round(case, rpi, lens, paths, before, n, f"round {r} {topk=} {steps=} {lens=} {paths=}")
        lens = [p + len(path) for p, path in zip(lens, paths)]
    assert lens[0] >= 128 and lens[1] >= 256, lens  # a C128 block closed in both requests


@pytest.mark.parametrize("fail_at", [2, 4, 7])  # 1-4: the hook's entry / C128 moves; 5-9: move_kv_cache's
def test_failure_mid_commit_leaves_the_pools_as_before(context, no_flashmla_schedule, monkeypatch, fail_at):
    gen = torch.Generator().manual_seed(37)
    lens, n = [126, 382], 8
    case = Case(lens, gen, n)
    rpi = torch.tensor([1, 2], dtype=torch.int32)
    seq_lens, rn, rs, out_loc, accept_index, accept_lens, inputs = tree_ready(case, gen, lens, rpi, n)
    before = snapshot(case.tree_pool)
    real, calls = commit_mod.move_records, []

    def failing(*args):
        calls.append(1)
        if len(calls) == fail_at:
            real(*args)  # this move lands, then the device "fails"
            raise RuntimeError("injected failure")
        return real(*args)

    monkeypatch.setattr(commit_mod, "move_records", failing)
    with pytest.raises(RuntimeError, match="injected"):
        commit(case.tree_pool, rpi, seq_lens, rn, rs, out_loc, accept_index, accept_lens)
    assert len(calls) == fail_at
    nothing = {k: torch.zeros(v.numel(), dtype=torch.bool) for k, v in before.items()}
    assert differing(snapshot(case.tree_pool), before, nothing) == {}, f"{fail_at=}"
    assert case.tree_pool.dsv4_tree_commit_log is None
    # the verify's rows are intact, so the same commit can run again and equals the chain run
    monkeypatch.setattr(commit_mod, "move_records", real)
    commit(case.tree_pool, rpi, seq_lens, rn, rs, out_loc, accept_index, accept_lens)
    paths = accepted_nodes(accept_index, accept_lens, n)
    ops = get_backend("torch")
    for b, path in enumerate(paths):
        chain_round(case.chain_pool, case.req_to_token, case.mapping, int(rpi[b]), lens[b],
                    inputs.rows(torch.tensor([b * n + a for a in path])), case.comps, ops)
    check_round(case, rpi, lens, paths, before, n, f"retry after {fail_at=} {paths=}")


@pytest.fixture
def tree_ring(monkeypatch):
    """The plug-in's ring hook on SGLang's `resolve_compress_state_ring_size`, as register() applies
    it in every SGLang process (the registry itself: test_sglang_plugin.py)."""
    from functools import partial

    from sglang.srt.mem_cache import deepseek_v4_memory_pool as mp

    from dsv4_tree.sglang_plugin.ring import around_resolve_compress_state_ring_size

    monkeypatch.setattr(mp, "resolve_compress_state_ring_size",
                        partial(around_resolve_compress_state_ring_size, mp.resolve_compress_state_ring_size))


def c4_rings(pool) -> set:
    return {sp.ring_size for sp in pool.compress_state_pools + pool.indexer_compress_state_pools
            if sp is not None and sp.ratio == 4}


N16 = 16  # past SGLang's bound of 10 for its C4 ring of 16 rows per SWA page


def next_round_rows(pool, req_to_token, rpi, new_lens) -> dict:
    """name -> the C4 state rows of positions P' - 7 .. P' - 1 of every request (P' its new length):
    what the next round's compressions read. The byte comparisons mask rows by the window's
    positions, which on a ring narrower than the window also names these rows; this reads them
    by position."""
    out = {}
    for name, pools in (("state", pool.compress_state_pools), ("index_state", pool.indexer_compress_state_pools)):
        for layer, sp in enumerate(pools):
            if sp is None or sp.ratio != 4:
                continue
            slots = torch.cat([req_to_token[int(r), p - 7:p] for r, p in zip(rpi, new_lens)]).to(torch.int64)
            swa = pool.translate_loc_from_full_to_swa(slots).to(torch.int64)
            out[f"{name}.{layer}"] = sp.kv_score_buffer.kv_score[sp.translate_from_swa_loc_to_state_loc(swa)].clone()
    return out


def test_rounds_in_a_row_at_sixteen_draft_tokens_with_the_grown_ring(tmp_path, no_flashmla_schedule, tree_ring):
    """N = 16 with the plug-in's C4 ring (32 rows per SWA page, write pad 26): round after round,
    committed state equals the chain run of the accepted paths and no write leaves the window;
    the branch compressor is the Triton kernel (interpreter). The backend's pool check accepts
    the pool."""
    from dsv4_tree.sglang_plugin.ring import check_pool_rings

    gen = torch.Generator().manual_seed(41)
    lens = [122, 250]  # the first windows close a C128 block in both requests; request 1's crosses a page
    assert all(p % 128 + N16 > 128 for p in lens) and 250 // 256 < (250 + N16) // 256
    with published_context(dsv4_dir(str(tmp_path)), N16, topk=4):
        install_move_kv_cache()
        case = Case(lens, gen, N16)
        assert c4_rings(case.tree_pool) == {32}
        check_pool_rings(case.tree_pool, N16)
        rpi = torch.tensor([1, 2], dtype=torch.int32)
        ops = get_backend("triton")
        for r, (topk, steps) in enumerate([(4, 2), (3, 3), (2, 5), (4, 3)]):
            paths, before, *_ = one_round(case, rpi, lens, topk, steps, N16, gen, ops, last_child=r % 2 == 1)
            label = f"round {r} {topk=} {steps=} {lens=} {paths=}"
            check_round(case, rpi, lens, paths, before, N16, label)
            lens = [p + len(path) for p, path in zip(lens, paths)]
            tree, chain = (next_round_rows(p, case.req_to_token, rpi, lens) for p in case.pools)
            assert sorted(tree) == ["index_state.0", "state.0"], label
            assert all(torch.equal(tree[k].view(torch.int32), chain[k].view(torch.int32)) for k in tree), label


def test_sixteen_draft_tokens_on_sglangs_ring_overwrite_committed_rows(tmp_path, no_flashmla_schedule):
    """Without the ring hook (SGLang's C4 ring of 16 rows per SWA page) the same window of 16
    writes nodes 10..15's state rows over the committed rows of positions P - 6 .. P - 1, which the
    next round's compressions read: after the commit they differ from the chain run's. The
    backend's pool check refuses such a pool by name."""
    from dsv4_tree.errors import ConfigError
    from dsv4_tree.sglang_plugin.ring import check_pool_rings

    gen = torch.Generator().manual_seed(41)
    lens = [117, 300]  # nodes 10..15 of both windows share an SWA page with positions P - 6 .. P - 1
    with published_context(dsv4_dir(str(tmp_path)), N16, topk=4):
        install_move_kv_cache()
        case = Case(lens, gen, N16)
        assert c4_rings(case.tree_pool) == {16}
        with pytest.raises(ConfigError, match="C4 state ring of 16 rows serves at most 10 draft tokens"):
            check_pool_rings(case.tree_pool, N16)
        rpi = torch.tensor([1, 2], dtype=torch.int32)
        paths, *_ = one_round(case, rpi, lens, 4, 2, N16, gen, get_backend("torch"))
        lens = [p + len(path) for p, path in zip(lens, paths)]
        tree, chain = (next_round_rows(p, case.req_to_token, rpi, lens) for p in case.pools)
        assert sorted(tree) == ["index_state.0", "state.0"]
        for k in tree:  # column j: position P' - 7 + j
            same = (tree[k].view(torch.int32) == chain[k].view(torch.int32)).all(dim=1).view(len(lens), 7)
            for b, path in enumerate(paths):
                kept = 7 - len(path)  # committed before the round (P - 6 .. P - 1 here): all overwritten
                assert not same[b, :kept].any() and same[b, kept:].all(), (k, b, path, same)
