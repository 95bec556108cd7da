"""`DeepSeekV4TokenToKVPool.move_kv_cache` (set by register(); SGLang 0.5.23 has none) on real
pools: it moves the SWA records and C4 state rows of full slots, joins the commit's undo log or
restores its own writes on a failure, and refuses every pool where it would move only part of
what a slot owns: pools the tree backend did not prepare (SGLang's NGRAM worker and PP relay call
it there), and pools with C4 / C128 layers outside the tree commit. The draft pool (no compressed
layers) keeps working: SGLang's own `duplicate_prefix_tail_to_draft_branches` on a draft pool
prepared as the tree multi-step backend prepares it."""
import pytest
import torch
from sglang.srt.speculative.eagle_worker_common import duplicate_prefix_tail_to_draft_branches

from dsv4_tree.errors import ConfigError, StateError
from dsv4_tree.sglang_plugin import commit as commit_mod
from dsv4_tree.sglang_plugin import install_move_kv_cache
from dsv4_tree.sglang_plugin.backend import TreeDeepseekV4MultiStepBackend
from dsv4_tree.sglang_plugin.pool_bytes import UndoLog
from dsv4_tree.sglang_plugin.scratch import pool_layers
from plugin_probe import dsv4_dir
from sgl_cases import PAGE, layout
from sgl_pool import fill_random, make_pool, published_context, snapshot
from sgl_round import Case, differing, unchanged, window_mask

DRAFT_RATIOS = (0, 0, 0)  # the MTP layer's compress ratio is 0: the draft pool has no compressed layers


@pytest.fixture(scope="module")
def context(tmp_path_factory):
    with published_context(dsv4_dir(str(tmp_path_factory.mktemp("models"))), 8):
        install_move_kv_cache()
        yield


class _Spec:
    speculative_eagle_topk, speculative_num_draft_tokens = 4, 8


def draft_pool(lens, gen):
    """A draft-like pool (no compressed layers) prepared by the tree multi-step backend's own
    `_tree_init` (what its constructor runs after SGLang's)."""
    req_to_token, mapping = layout(lens, 8, gen, max_len=1024)
    pool = make_pool(req_to_token.shape[0] * 4 + 1, req_to_token.shape[0], mapping, ratios=DRAFT_RATIOS)
    fill_random(pool, gen)
    backend = object.__new__(TreeDeepseekV4MultiStepBackend)
    backend.token_to_kv_pool, backend.low_ratios = pool, ()
    backend._tree_init(_Spec)
    assert pool.dsv4_tree_scratch is not None
    return pool, req_to_token


def test_unprepared_pools_are_refused(context):
    gen = torch.Generator().manual_seed(3)
    req_to_token, mapping = layout([40], 8, gen, max_len=1024)
    for ratios in (DRAFT_RATIOS, (4, 128, 0)):
        pool = make_pool(req_to_token.shape[0] * 4 + 1, req_to_token.shape[0], mapping, ratios=ratios)
        before = snapshot(pool)
        with pytest.raises(ConfigError, match="not prepared by the tree backend"):
            pool.move_kv_cache(req_to_token[1, 4:6].to(torch.int64), req_to_token[1, 0:2].to(torch.int64))
        assert differing(snapshot(pool), before, unchanged(before)) == {}


def test_target_pool_outside_the_commit_is_refused(context):
    gen = torch.Generator().manual_seed(5)
    case = Case([40, 300], gen, 8)
    pool, r2t = case.tree_pool, case.req_to_token
    before = snapshot(pool)
    with pytest.raises(ConfigError, match=r"outside the tree commit .*ratios \[4, 128\]"):
        pool.move_kv_cache(r2t[2, 296:300].to(torch.int64), r2t[1, 36:40].to(torch.int64))
    assert differing(snapshot(pool), before, unchanged(before)) == {}


def test_inside_a_commit_it_moves_swa_records_and_c4_state_rows(context):
    gen = torch.Generator().manual_seed(43)
    case = Case([40, 300], gen, 8)
    pool, r2t = case.tree_pool, case.req_to_token
    src, tgt = r2t[1, 36:40].to(torch.int64), r2t[2, 296:300].to(torch.int64)
    before = snapshot(pool)
    log = UndoLog()
    pool.dsv4_tree_commit_log = log  # what run_tree_commit sets while the hook runs
    try:
        pool.move_kv_cache(torch.cat([tgt, torch.zeros(2, dtype=torch.int64)]),
                           torch.cat([src, torch.zeros(2, dtype=torch.int64)]))  # SGLang's zero padding
    finally:
        pool.dsv4_tree_commit_log = None
    swa_s, swa_t = pool.translate_loc_from_full_to_swa(src), pool.translate_loc_from_full_to_swa(tgt)
    for lb in pool_layers(pool):
        assert torch.equal(lb.swa.read(swa_t), lb.swa.read(swa_s))
        for sp in (lb.state, lb.index_state):
            if sp is not None and sp.ratio == 4:
                rows = sp.kv_score_buffer.kv_score
                assert torch.equal(rows[sp.translate_from_swa_loc_to_state_loc(swa_t.clone())],
                                   rows[sp.translate_from_swa_loc_to_state_loc(swa_s.clone())])
    target_slots = window_mask(pool, r2t, [(2, 296, 300)])
    for k in target_slots:  # only SWA records and C4 state rows: entries and C128 rows are the commit's
        if not (k.startswith("swa.") or k in ("state.0", "index_state.0")):
            target_slots[k][:] = False
    assert differing(snapshot(pool), before, target_slots) == {}
    assert log.entries  # the writes joined the commit's log: its rollback undoes them
    log.rollback()
    assert differing(snapshot(pool), before, unchanged(before)) == {}


def test_draft_pool_alone_moves_restores_and_checks_bounds(context, monkeypatch):
    gen = torch.Generator().manual_seed(47)
    pool, r2t = draft_pool([40, 300], gen)
    src, tgt = r2t[1, 36:40].to(torch.int64), r2t[2, 296:300].to(torch.int64)
    pool.move_kv_cache(tgt, src)
    swa_s, swa_t = pool.translate_loc_from_full_to_swa(src), pool.translate_loc_from_full_to_swa(tgt)
    for lb in pool_layers(pool):
        assert torch.equal(lb.swa.read(swa_t), lb.swa.read(swa_s))
    moved = snapshot(pool)
    real, calls = commit_mod.move_records, []

    def failing(*args):
        calls.append(1)
        real(*args)
        if len(calls) == 3:
            raise RuntimeError("injected failure")

    monkeypatch.setattr(commit_mod, "move_records", failing)
    with pytest.raises(RuntimeError, match="injected"):
        pool.move_kv_cache(r2t[2, 300:304].to(torch.int64), src)
    assert differing(snapshot(pool), moved, unchanged(moved)) == {}
    monkeypatch.setattr(commit_mod, "move_records", real)
    with pytest.raises(StateError, match="outside"):
        pool.move_kv_cache(torch.tensor([pool.full_to_swa_index_mapping.shape[0]]), src[:1])


def test_sglang_duplicate_prefix_tail_on_the_draft_pool(context):
    """SGLang's prepare_for_draft copy (page size 256, topk 3): each branch region's leading
    holes get the prefix tail page's records; nothing else changes."""
    gen = torch.Generator().manual_seed(53)
    lens, topk, steps = [300, 420], 3, 3
    pool, r2t = draft_pool(lens, gen)
    bs = len(lens)
    rows = r2t[1:bs + 1].to(torch.int64)
    seq = torch.tensor(lens)
    last_page = seq % PAGE
    prefix_base = seq - last_page
    num_new_pages = (last_page + steps + PAGE - 1) // PAGE
    before = snapshot(pool)
    duplicate_prefix_tail_to_draft_branches(pool, rows, prefix_base, last_page, num_new_pages, topk, PAGE)
    layers = pool_layers(pool)
    touched = {k: torch.zeros(v.numel(), dtype=torch.bool) for k, v in before.items()}
    for b in range(bs):
        p0, lp = int(prefix_base[b]), int(last_page[b])
        src = rows[b, p0:p0 + lp]
        for t in range(1, topk):
            base = p0 + t * int(num_new_pages[b]) * PAGE
            tgt = rows[b, base:base + lp]
            swa_t = pool.translate_loc_from_full_to_swa(tgt)
            for i, lb in enumerate(layers):
                assert torch.equal(lb.swa.read(swa_t), lb.swa.read(pool.translate_loc_from_full_to_swa(src))), (b, t)
                touched[f"swa.{i}"][lb.swa.element_index(swa_t).view(-1)] = True
    assert any(m.any() for m in touched.values())
    assert differing(snapshot(pool), before, touched) == {}


def test_inside_a_commit_it_reads_nothing_on_the_host(context):
    """SGLang's commit moves (its zero padding, a root's self-move) inside the commit: fixed shape,
    no host read (the hook checked the window's slots), the same bytes as the moves alone."""
    from sgl_graph import captured

    gen = torch.Generator().manual_seed(59)
    case = Case([40, 300], gen, 8)
    r2t = case.req_to_token
    src, tgt = r2t[1, 36:40].to(torch.int64), r2t[2, 296:300].to(torch.int64)
    root = r2t[2, 300:301].to(torch.int64)
    zeros = torch.zeros(3, dtype=torch.int64)
    results = []
    for pool, pairs in ((case.tree_pool, (torch.cat([root, tgt, zeros]), torch.cat([root, src, zeros]))),
                        (case.chain_pool, (tgt, src))):
        pool.dsv4_tree_commit_log = UndoLog()
        try:
            if pool is case.tree_pool:
                with captured():
                    pool.move_kv_cache(*pairs)
            else:
                pool.dsv4_tree_commit_log = None
                check = commit_mod.check_move_allowed
                commit_mod.check_move_allowed = lambda p: None  # the plain path on a pool with compressed layers
                try:
                    pool.move_kv_cache(*pairs)
                finally:
                    commit_mod.check_move_allowed = check
        finally:
            pool.dsv4_tree_commit_log = None
        results.append(snapshot(pool))
    assert differing(results[0], results[1], unchanged(results[0])) == {}


def test_the_commit_checks_the_window_slots_before_writing(context, no_flashmla_schedule):
    from sgl_round import commit, greedy_accept, random_targets, tree_ready

    gen = torch.Generator().manual_seed(61)
    lens, n = [40, 300], 8
    case = Case(lens, gen, n)
    rpi = torch.tensor([1, 2], dtype=torch.int32)
    seq_lens, rn, rs, out_loc, accept_index, accept_lens, _ = tree_ready(case, gen, lens, rpi, n)
    before = snapshot(case.tree_pool)
    bad = out_loc.clone()
    bad[3] = case.tree_pool.full_to_swa_index_mapping.shape[0]  # past the last full slot
    with pytest.raises(StateError, match="out_cache_loc must name full slots"):
        commit(case.tree_pool, rpi, seq_lens, rn, rs, bad, accept_index, accept_lens)
    assert differing(snapshot(case.tree_pool), before, unchanged(before)) == {}
