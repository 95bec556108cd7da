"""The Triton commit (kernels/commit_moves.py): one launch moves every pool's records for the
whole batch, bitwise the torch commit's (serving/commit.py: apply_moves, the reference)."""
import pytest
import torch

import dsv4_tree as dt
from cases import engine_for, random_tree, small_model
from dsv4_tree import kernels
from dsv4_tree.diagnostics import LaunchCounter
from dsv4_tree.serving.commit import apply_moves, pool_segments


def _storages(rt) -> list:
    """Every tensor commit may write, as uint8 views (raw rows, compressor rows, entries)."""
    out = []
    for lp in rt.pools:
        out.append(lp.swa.storage)
        for comp in lp.compressors:
            out += [comp.rows_kv, comp.rows_gate, comp.entries.storage]
    return [t.view(torch.uint8) for t in out]


def _deepest_path(tree) -> tuple:
    leaf = int(tree.leaves[torch.argmax(tree.depth[tree.leaves])])
    path = tree.path[leaf]
    return tuple(int(x) for x in path[path >= 0].tolist())


def _mapped_batch(kv: str, seq_lens, page_size: int, nodes: int = 24):
    """A runtime whose requests (rows) have P = seq_lens committed positions and a deep random
    tree's draft slots mapped, random bytes in every pool; each tree's deepest path and the
    pools' segment table. Moves need only mapped slots: nothing is prefilled or verified."""
    rt = engine_for(small_model(), kv_cache_dtype=kv, page_size=page_size, max_requests=len(seq_lens)).runtime
    rows = [rt.admit() for _ in seq_lens]
    rt.pages.ensure(rows, [p + nodes for p in seq_lens], [p - rt.layout.recent_window for p in seq_lens])
    paths = [_deepest_path(random_tree(5, nodes, 9, 2, seed=i)) for i in range(len(seq_lens))]
    gen = torch.Generator().manual_seed(3)
    for t in _storages(rt):  # random bytes everywhere: a wrong byte offset shows
        t.copy_(torch.randint(0, 256, t.shape, generator=gen, dtype=torch.uint8))
    return rt, rows, paths, pool_segments(rt.pools, rt.layout)


# P values put the deepest paths across C4 blocks and the C128-style (ratio 16) block at 32 / 48
@pytest.mark.parametrize("kv,page_size", [("fp8_e4m3", 16), ("fp8_e4m3", 256), ("auto", 16)])
def test_triton_commit_moves_pool_bytes_bitwise_as_the_torch_commit(kv, page_size):
    seq_lens = [27, 41, 13]
    rt, rows, paths, segments = _mapped_batch(kv, seq_lens, page_size)
    moves = rt.prepare_commit(rows, seq_lens, paths)
    assert all(c > 0 for c in moves.counts), f"every move group must be exercised: {moves.counts} {paths=}"
    before = [t.clone() for t in _storages(rt)]
    apply_moves(rt.pools, moves)  # the torch commit
    want = [t.clone() for t in _storages(rt)]
    for t, b in zip(_storages(rt), before):
        t.copy_(b)
    with LaunchCounter() as launches:
        apply_moves(rt.pools, moves, segments=segments, move_records=kernels.move_records)
    got = _storages(rt)
    assert launches.by_name == {"triton._move_kernel": 1}, dict(launches.by_name)
    assert any(not torch.equal(w, b) for w, b in zip(want, before)), "the moves changed nothing"
    for i, (g, w) in enumerate(zip(got, want)):
        diff = int((g != w).sum())
        assert diff == 0, f"{kv=} {page_size=} storage {i}: {diff} bytes differ from the torch commit"


def test_triton_commit_is_one_launch_whatever_the_batch():
    seq_lens = [27, 41, 13]
    rt, rows, paths, segments = _mapped_batch("fp8_e4m3", seq_lens, 16)
    for bs in (1, 2, 3):
        moves = rt.prepare_commit(rows[:bs], seq_lens[:bs], paths[:bs])
        with LaunchCounter() as launches:
            apply_moves(rt.pools, moves, segments=segments, move_records=kernels.move_records)
        assert launches.by_name == {"triton._move_kernel": 1}, f"{bs=} {dict(launches.by_name)}"


def test_the_triton_backend_selects_the_commit_kernel():
    model = small_model()
    assert engine_for(model, attention_backend="triton").runtime.segments is not None
    assert engine_for(model).runtime.segments is None


def test_triton_commit_refuses_moves_of_other_ratios_before_writing():
    rt, rows, paths, segments = _mapped_batch("fp8_e4m3", [27], 16)
    moves = rt.prepare_commit(rows, [27], paths)
    other = type(moves)(moves.src, moves.dst, moves.bounds, moves.counts, (8,) * len(moves.ratios), ())
    before = [t.clone() for t in _storages(rt)]
    called = []
    with pytest.raises(dt.InputError, match="ratios"):
        apply_moves(rt.pools, other, lambda: called.append(1), segments, kernels.move_records)
    assert not called and all(torch.equal(t, b) for t, b in zip(_storages(rt), before))


def test_triton_commit_refuses_pools_whose_storage_moved():
    rt, rows, paths, segments = _mapped_batch("fp8_e4m3", [27], 16)
    moves = rt.prepare_commit(rows, [27], paths)
    old = rt.pools[1].swa.storage  # kept alive: the table still points at it
    rt.pools[1].swa.storage = old.clone()
    before = [t.clone() for t in _storages(rt)]
    with pytest.raises(dt.StateError, match="moved"):
        apply_moves(rt.pools, moves, segments=segments, move_records=kernels.move_records)
    assert all(torch.equal(t, b) for t, b in zip(_storages(rt), before)) and old.data_ptr()


def test_move_records_checks_its_arguments():
    from dsv4_tree import kernels

    seg = torch.zeros(2, 6, dtype=torch.int64)
    idx = torch.zeros(3, dtype=torch.int64)
    bounds = torch.tensor([[0, 3]], dtype=torch.int64)
    with pytest.raises(dt.InputError, match="segments"):
        kernels.move_records(seg[:, :5].contiguous(), idx, idx, bounds, 8)
    with pytest.raises(dt.InputError, match="src and dst"):
        kernels.move_records(seg, idx, idx[:2], bounds, 8)
    with pytest.raises(dt.InputError, match="dtype"):
        kernels.move_records(seg, idx.int(), idx, bounds, 8)
    with pytest.raises(dt.InputError, match="max_width"):
        kernels.move_records(seg, idx, idx, bounds, 0)


def test_commit_refuses_segments_without_their_kernel_before_writing():
    rt, rows, paths, segments = _mapped_batch("fp8_e4m3", [27], 16)
    moves = rt.prepare_commit(rows, [27], paths)
    before = [t.clone() for t in _storages(rt)]
    for kwargs in (dict(segments=segments), dict(move_records=kernels.move_records)):
        with pytest.raises(dt.InputError, match="segments and move_records together"):
            apply_moves(rt.pools, moves, **kwargs)
        assert all(torch.equal(t, b) for t, b in zip(_storages(rt), before)), kwargs
