"""Engine.commit's cost: one host-to-device copy and a fixed number of device ops whatever the
batch, and a token history that grows in amortised O(1) (no copy of the whole history per commit)."""
import math

import pytest
import torch

import dsv4_tree as dt
import dsv4_tree.engine as engine_mod
from cases import engine_for, prompt, small_model, snapshot
from dsv4_tree.diagnostics import HostToDeviceCounter, OpCounter
from dsv4_tree.request import TokenHistory
from test_device_step import DeviceOps, meta_engine

# accepted path 0-2-5-6: nodes verified at slots P+2, P+5, P+6 move to P+1..P+3 (row moves in
# every pool), and with P = 12 + 4b the path closes a C4 block in every request
PARENTS = torch.tensor([-1, 0, 0, 1, 2, 2, 5, 6])
PATH = (0, 2, 5, 6)


def commit_cost(bs: int) -> tuple:
    """(host-to-device copies, aten ops, device ops) of one Engine.commit of bs requests (meta device)."""
    eng = meta_engine(max_requests=8)
    reqs = [eng.prefill(prompt(13 + 4 * b, b)) for b in range(bs)]
    trees = [dt.DraftTree(torch.tensor([r.root_token, 11, 12, 13, 14, 15, 16, 17]), PARENTS) for r in reqs]
    out = eng.verify(reqs, trees)
    accs = [dt.Acceptance(PATH, 9, r.request_id, out.verify_id) for r in reqs]
    lens = [r.seq_len for r in reqs]
    with HostToDeviceCounter() as h2d, OpCounter() as ops, DeviceOps() as dev:
        eng.commit(reqs, accs, out)
    assert [r.seq_len for r in reqs] == [p + len(PATH) for p in lens], f"{bs=}"
    assert all(r.tokens[-len(PATH):].tolist() == [t.tokens[0].item(), 12, 15, 16] for r, t in zip(reqs, trees)), f"{bs=}"
    assert all(r.new_hidden.shape[0] == len(PATH) and r.new_hidden.device.type == "meta" for r in reqs), f"{bs=}"
    return h2d.copies, ops.total, dev.total


def test_commit_takes_one_copy_and_a_fixed_number_of_device_ops_whatever_the_batch():
    (h1, ops1, dev1), (h8, ops8, dev8) = commit_cost(1), commit_cost(8)
    assert (h1, h8) == (1, 1), f"host-to-device copies per commit: batch 1 {h1}, batch 8 {h8}"
    assert dev8 == dev1, f"device ops per commit: batch 1 {dev1}, batch 8 {dev8}"
    # what grows is host work each request needs for its own history buffer: a slice of it and
    # a copy of its accepted ids into that slice
    assert ops8 - ops1 <= 2 * 7, f"aten ops per commit: batch 1 {ops1}, batch 8 {ops8}"


def test_token_history_reallocates_a_logarithmic_number_of_times():
    hist, want, views = TokenHistory(torch.arange(5)), list(range(5)), []
    for i in range(20_000):
        ids = torch.full((1 + i % 5,), i, dtype=torch.int64)
        hist.append(ids)
        want += ids.tolist()
        if i % 4_000 == 0:
            views.append((hist.view(), list(want)))
    assert len(hist) == len(want) and hist.view().tolist() == want
    bound = math.ceil(math.log2(len(want) / TokenHistory.MIN_CAPACITY)) + 1  # one per doubling
    assert hist.reallocations <= bound, f"{hist.reallocations=} for {len(want)} ids ({bound=})"
    for view, seen in views:  # a view read earlier keeps its values
        assert view.tolist() == seen


def test_commits_append_to_the_history_and_earlier_reads_keep_their_values():
    eng = engine_for(small_model(), topk=1, steps=8, nodes=9)
    p = prompt(13, 3)
    req = eng.prefill(p)
    want, reads = p[:-1].tolist(), []
    for rnd in range(10):
        chain = [req.root_token] + [2 + rnd + i for i in range(8)]
        out = eng.verify([req], [dt.DraftTree.chain(chain)])
        eng.commit([req], [dt.Acceptance(tuple(range(9)), 5 + rnd, req.request_id, out.verify_id)], out)
        want += chain
        reads.append((req.tokens, list(want)))
    assert req.tokens.tolist() == want and req.seq_len == len(want)
    for tokens, seen in reads:
        assert tokens.tolist() == seen
    bound = math.ceil(math.log2(len(want) / TokenHistory.MIN_CAPACITY)) + 1
    assert req.history.reallocations <= bound, f"{req.history.reallocations=} over 10 commits ({bound=})"


def test_a_commit_failing_in_its_device_gathers_changes_nothing(monkeypatch):
    eng = engine_for(small_model(), topk=1, steps=4, nodes=5)
    reqs = [eng.prefill(prompt(n, n)) for n in (13, 21)]
    trees = [dt.DraftTree.chain([r.root_token, 7, 8, 9]) for r in reqs]
    out = eng.verify(reqs, trees)
    accs = [dt.Acceptance((0, 1, 2), 4, r.request_id, out.verify_id) for r in reqs]
    before = [(r.seq_len, r.root_token, r.tokens.clone(), r.committed_topk_ties, snapshot(eng, r)) for r in reqs]

    def boom(*args):
        raise RuntimeError("injected failure in the commit's tie count")

    with monkeypatch.context() as m:
        m.setattr(engine_mod, "accumulated_ties", boom)
        with pytest.raises(RuntimeError, match="injected"):
            eng.commit(reqs, accs, out)
    for b, (r, (n, root, toks, ties, state)) in enumerate(zip(reqs, before)):
        assert (r.seq_len, r.root_token, r.committed_topk_ties) == (n, root, ties), f"{b=}"
        assert torch.equal(r.tokens, toks), f"{b=}"
        assert all(torch.equal(x[k], y[k]) for x, y in zip(state, snapshot(eng, r)) for k in x), f"{b=}"
    eng.commit(reqs, accs, out)  # nothing was copied: the same output still commits
    assert [r.seq_len for r in reqs] == [n + 3 for n, *_ in before]
    assert [r.tokens[-3:].tolist() for r in reqs] == [[r0, 7, 8] for _, r0, *_ in before]
