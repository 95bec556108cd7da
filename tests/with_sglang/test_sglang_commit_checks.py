"""What the tree commit refuses, on SGLang 0.5.23's own DeepSeekV4TokenToKVPool (CPU), before any
write: an `accept_index` / `accept_lens` that is not a root-first path of the verified tree (each
bound named), and a verify whose commit never ran after SGLang's C128 cleanup was skipped for it
(`finalize_tree_path=False` paths): the skip is recorded on the pool and only the commit
consumes it."""
import re

import pytest
import torch
from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool

from dsv4_tree.attention.backend import get_backend
from dsv4_tree.errors import StateError
from dsv4_tree.sglang_plugin import hooks, install_move_kv_cache
from dsv4_tree.sglang_plugin.tables import parents_from_retrieve
from plugin_probe import dsv4_dir
from sgl_cases import sglang_tree
from sgl_pool import published_context, snapshot
from sgl_round import Case, NodeInputs, commit, depth_of, differing, tree_ready, unchanged, verify_writes


@pytest.fixture(scope="module")
def context(tmp_path_factory):
    with published_context(dsv4_dir(str(tmp_path_factory.mktemp("models"))), 10):
        install_move_kv_cache()
        yield


@pytest.fixture
def ready(context, no_flashmla_schedule):
    gen = torch.Generator().manual_seed(41)
    lens, n = [60, 127], 8
    case = Case(lens, gen, n)
    rpi = torch.tensor([1, 2], dtype=torch.int32)
    seq_lens, rn, rs, out_loc, accept_index, accept_lens, _ = tree_ready(case, gen, lens, rpi, n, 3, 3)
    return case, rpi, seq_lens, rn, rs, out_loc, accept_index, accept_lens, n


def other_branch_path(rn, rs):
    """[0, a, c] for request 0 with a at depth 1 and c at depth 2 whose parent is not a."""
    parents, depth = parents_from_retrieve(rn, rs)[0], depth_of(rn, rs)[0]
    for a in (depth == 1).nonzero().view(-1).tolist():
        for c in (depth == 2).nonzero().view(-1).tolist():
            if int(parents[c]) != a:
                return [0, a, c]
    raise AssertionError("tree without two depth-2 branches")


def bad_cases(accept_index, accept_lens, rn, rs, n):
    depth = depth_of(rn, rs)
    deep = int((depth[0] == 2).nonzero()[0])
    d1_next = int((depth[1] == 1).nonzero()[0])
    S = accept_index.shape[1]
    cases = []
    x = accept_index.clone()
    x[0, :3] = torch.tensor(other_branch_path(rn, rs), dtype=x.dtype)  # a depth-2 node of another branch
    cases.append(("accept_index[b, d]'s parent must be accept_index[b, d-1]", x, [3, 1]))
    x = accept_index.clone()
    x[0, 1] = deep  # a depth-2 node where depth 1 belongs
    cases.append(("accept_index[b, d] must be a node at depth d", x, [2, 1]))
    x = accept_index.clone()
    x[0, 1] = n + d1_next  # request 1's depth-1 node in request 0's path
    cases.append((f"request b's own node ids b*{n} .. b*{n}+{n - 1}", x, [2, 1]))
    x = accept_index.clone()
    x[1, 0] = 0  # request 0's root as request 1's
    cases.append(("request b's own node ids", x, [1, 1]))
    cases.append((f"accept_lens must be in [1, {S}]", accept_index.clone(), [1, 0]))
    cases.append((f"accept_lens must be in [1, {S}]", accept_index.clone(), [S + 1, 1]))
    return [(named, bad, torch.tensor(lens, dtype=torch.int32)) for named, bad, lens in cases]


def test_a_commit_that_is_not_a_path_is_refused_before_any_write(ready):
    case, rpi, seq_lens, rn, rs, out_loc, accept_index, accept_lens, n = ready
    for named, bad, lens in bad_cases(accept_index, accept_lens, rn, rs, n):
        before = snapshot(case.tree_pool)
        with pytest.raises(StateError, match="not a root-first path.*" + re.escape(named)):
            commit(case.tree_pool, rpi, seq_lens, rn, rs, out_loc, bad, lens)
        assert differing(snapshot(case.tree_pool), before, unchanged(before)) == {}, named
    commit(case.tree_pool, rpi, seq_lens, rn, rs, out_loc, accept_index, accept_lens)  # the real path commits
    assert case.tree_pool.dsv4_tree_commit_pending is False


def _cleanup(pool, rpi, seq_lens, accept_lens, n):
    return hooks.around_clear_unaccepted_c128_draft_states(
        DeepSeekV4TokenToKVPool.clear_unaccepted_c128_draft_states, pool, rpi, seq_lens, accept_lens, n)


def test_a_skipped_cleanup_without_its_commit_is_refused(ready):
    case, rpi, seq_lens, rn, rs, out_loc, accept_index, accept_lens, n = ready
    pool = case.tree_pool
    before = snapshot(pool)
    _cleanup(pool, rpi, seq_lens, accept_lens, n)  # skipped on a tree pool, recorded
    assert pool.dsv4_tree_commit_pending is True
    assert differing(snapshot(pool), before, unchanged(before)) == {}
    with pytest.raises(StateError, match="C128 cleanup .* still pending"):
        _cleanup(pool, rpi, seq_lens, accept_lens, n)  # the next round's cleanup, no commit in between
    gen = torch.Generator().manual_seed(2)
    _, rn2, rs2 = sglang_tree(2, 3, 3, n, seq_lens, gen)
    with pytest.raises(StateError, match="a tree verify with the previous verify's tree commit still pending"):
        verify_writes(pool, case.req_to_token, case.mapping, rpi, seq_lens, rn2, rs2,
                      NodeInputs.draw(2 * n, case.comps, gen), case.comps, get_backend("torch"))
    assert differing(snapshot(pool), before, unchanged(before)) == {}
    # the commit takes the skip over (commit() runs SGLang's order: cleanup, then the finalize hook)
    pool.dsv4_tree_commit_pending = False
    commit(pool, rpi, seq_lens, rn, rs, out_loc, accept_index, accept_lens)
    assert pool.dsv4_tree_commit_pending is False


def test_pools_the_tree_backend_did_not_prepare_get_sglangs_cleanup(context):
    calls = []
    plain = type("Pool", (), {})()
    hooks.around_clear_unaccepted_c128_draft_states(lambda pool, *a: calls.append((pool, a)), plain, 1, 2, 3, 4)
    assert calls == [(plain, (1, 2, 3, 4))] and not hasattr(plain, "dsv4_tree_commit_pending")


def test_the_commit_plan_and_its_moves_are_fixed_shape(ready):
    """No nonzero, boolean-mask indexing or scalar read while planning and applying the tree
    commit's own moves (the path check's one `.tolist()` is the only host read, not dispatched on
    CPU); the result equals the commit run without the guard."""
    from dsv4_tree.diagnostics import forbid_host_sync
    from dsv4_tree.sglang_plugin.commit import apply_tree_commit, c128_ring_size, plan_tree_commit
    from dsv4_tree.sglang_plugin.pool_bytes import UndoLog

    case, rpi, seq_lens, rn, rs, out_loc, accept_index, accept_lens, n = ready
    pool = case.tree_pool
    kw = dict(req_pool_indices=rpi, seq_lens=seq_lens, retrieve_next_token=rn, retrieve_next_sibling=rs,
              out_cache_loc=out_loc, accept_index=accept_index, accept_lens=accept_lens,
              scratch=pool.dsv4_tree_scratch, c128_ring=c128_ring_size(pool))
    before = snapshot(pool)
    log = UndoLog()
    with forbid_host_sync():
        plan = plan_tree_commit(**kw)
        apply_tree_commit(log, pool, plan)
    guarded = snapshot(pool)
    log.rollback()
    assert differing(snapshot(pool), before, unchanged(before)) == {}
    apply_tree_commit(UndoLog(), pool, plan_tree_commit(**kw))
    assert differing(snapshot(pool), guarded, unchanged(guarded)) == {}
    assert differing(guarded, before, unchanged(before)) != {}  # it moved something
