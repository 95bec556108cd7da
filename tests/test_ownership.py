"""Who may touch a request's state: requests of another engine are refused, a verify or commit
that fails half-way leaves its outputs refused (never committed over moved or overwritten
draft rows), rows are adopted once, and nothing outlives what it belongs to."""
import gc

import pytest
import torch

import dsv4_tree as dt
from cases import engine_for, prompt, random_tree, small_model
from dsv4_tree.drafters import PlantedDrafter, TreeShape
from dsv4_tree.drafters.registry import resolve_drafter
from dsv4_tree.serving.kv_pool import KVPool
from test_commit import assert_same_state, serial_decode
from test_mtp import mtp_model


def _round(eng, req, seed):
    tree = random_tree(req.root_token, 12, 5, 3, seed)
    out = eng.verify([req], [tree])
    return tree, out, eng.accept_greedy([req], [tree], out)


def test_requests_of_another_engine_are_refused_and_change_nothing():
    model = small_model()
    a, b = engine_for(model, topk=4, steps=5, nodes=12), engine_for(model, topk=4, steps=5, nodes=12)
    ra, rb = a.prefill(prompt(21, 1)), b.prefill(prompt(17, 2))
    assert ra.row == rb.row  # both engines' first row: the other's pools would be read and written
    before = b.state_summary(rb)
    tree = random_tree(ra.root_token, 8, 4, 3, 0)
    with pytest.raises(dt.StateError, match="another Engine"):
        b.verify([ra], [tree])
    with pytest.raises(dt.StateError, match="another Engine"):
        b.verify([rb, ra], [random_tree(rb.root_token, 8, 4, 3, 1), tree])
    out = a.verify([ra], [tree])
    acc = a.accept_greedy([ra], [tree], out)
    with pytest.raises(dt.StateError, match="another Engine"):
        b.commit([ra], acc, out)
    for call in (b.release, b.state_summary):
        with pytest.raises(dt.StateError, match="another Engine"):
            call(ra)
    after = b.state_summary(rb)
    assert all(torch.equal(x[k], y[k]) for x, y in zip(before, after) for k in x)
    a.commit([ra], acc, out)  # the owner still can
    assert ra.seq_len == 20 + len(acc[0].path)


def _fail_on_call(monkeypatch, cls, name, n):
    """Make cls.name raise on its n-th call from now on."""
    real, calls = getattr(cls, name), [0]

    def wrapped(self, *args, **kw):
        calls[0] += 1
        if calls[0] == n:
            raise RuntimeError(f"injected failure in {cls.__name__}.{name} call {n}")
        return real(self, *args, **kw)

    monkeypatch.setattr(cls, name, wrapped)
    return calls


def test_a_commit_that_failed_part_way_cannot_be_retried(monkeypatch):
    model = small_model()
    eng = engine_for(model, topk=4, steps=5, nodes=12)
    p = prompt(22, 3)
    req = eng.prefill(p)
    tree = PlantedDrafter(model, TreeShape(4, 5, 12), corrupt=0.0, seed=0).draft(eng, [req])[0]
    out = eng.verify([req], [tree])
    accs = eng.accept_greedy([req], [tree], out)
    path = accs[0].path
    assert len(path) >= 3 and path != tuple(range(len(path))), path  # rows to move in every pool
    calls = _fail_on_call(monkeypatch, KVPool, "copy", 3)
    with pytest.raises(RuntimeError, match="injected"):
        eng.commit([req], accs, out)
    assert calls[0] == 3 and req.seq_len == 21
    monkeypatch.undo()
    with pytest.raises(dt.StateError, match="failed part-way"):
        eng.commit([req], accs, out)  # the retry would move rows the failed commit moved over
    tree2, out2, accs2 = _round(eng, req, 4)  # verify again: the draft rows are rewritten
    eng.commit([req], accs2, out2)
    emitted = accs2[0].emitted(tree2)
    ref = serial_decode(eng, p, emitted)
    assert_same_state(eng, req, ref, "after a failed commit, re-verify and commit")


def test_an_older_output_cannot_commit_after_a_verify_failed_mid_forward(monkeypatch):
    model = small_model()
    eng = engine_for(model, topk=4, steps=5, nodes=12)
    p = prompt(22, 5)
    req = eng.prefill(p)
    tree, out, accs = _round(eng, req, 6)
    # the second verify writes some layers' rows into the same draft slots, then fails
    _fail_on_call(monkeypatch, KVPool, "write", 2)
    with pytest.raises(RuntimeError, match="injected"):
        eng.verify([req], [random_tree(req.root_token, 12, 5, 3, 7)])
    monkeypatch.undo()
    with pytest.raises(dt.StateError, match="failed part-way"):
        eng.commit([req], accs, out)
    with pytest.raises(dt.StateError):
        eng.accept_greedy([req], [tree], out)
    tree, out, accs = _round(eng, req, 6)
    eng.commit([req], accs, out)
    assert_same_state(eng, req, serial_decode(eng, p, accs[0].emitted(tree)), "after a failed verify")


def test_adopt_checks_its_row():
    eng = engine_for(small_model(), topk=1, steps=3, nodes=4, max_requests=2)
    with pytest.raises(dt.InputError, match=r"row must be an int in \[0, 2\)"):
        eng.adopt(torch.zeros(0, dtype=torch.int64), 5, 999)
    with pytest.raises(dt.StateError, match="not admitted"):
        eng.adopt(torch.zeros(0, dtype=torch.int64), 5, 1)
    req = eng.prefill(prompt(6, 1))
    with pytest.raises(dt.StateError, match="held by live request"):
        eng.adopt(torch.zeros(0, dtype=torch.int64), 5, req.row)
    row = eng.runtime.admit()
    with pytest.raises(dt.InputError, match="root_token"):
        eng.adopt(torch.zeros(0, dtype=torch.int64), 10**6, row)
    mine = eng.adopt(torch.zeros(0, dtype=torch.int64), 5, row)
    assert mine.row == row and mine.engine_id == eng.engine_id


def test_adopt_refuses_committed_positions_it_cannot_back():
    eng = engine_for(small_model(), topk=1, steps=3, nodes=4, max_requests=2, page_size=16)
    rt, ids = eng.runtime, prompt(40, 5)
    gone = eng.prefill(prompt(50, 4))
    eng.release(gone)  # its rows stay in the pools' bytes: pages mapped now would hold them
    row = rt.admit()
    assert row == gone.row
    before = (rt.live_slots(), rt.pages.free_rows, rt.pages.mapped[row])
    with pytest.raises(dt.StateError, match=rf"seq_len=40: row {row} has no committed state behind it"):
        eng.adopt(ids, 5, row, 40)
    cases = [(ids[:39], 40, "tokens holds 39 ids but seq_len=40"), (ids, 0, "tokens holds 40 ids but seq_len=0"),
             (ids.float(), 40, "tokens must be a 1-D tensor of integer token ids"),
             (ids.view(2, 20), 40, "tokens must be a 1-D tensor"), (ids.tolist(), 40, "tokens must be a 1-D tensor"),
             (torch.full((40,), 10**6), 40, r"tokens: token id 1000000 outside the vocabulary"),
             (ids, -1, r"seq_len must be an int in \[0, 512\)"), (ids, 512, "max_position_embeddings=512"),
             (ids, 40.0, "seq_len must be an int")]
    for tokens, seq_len, msg in cases:
        with pytest.raises(dt.InputError, match=msg):
            eng.adopt(tokens, 5, row, seq_len)
    # token pages for every position but no recent page for the first of the last R: refused too
    r = rt.layout.recent_window
    assert r == 16, r  # positions 24..39 need recent pages: pages 1 and 2 of 16 slots
    rt.pages.ensure([row], [40], [40])  # gives a recent page to page 2 only
    with pytest.raises(dt.StateError, match=rf"recent pages from position {40 - r} on"):
        eng.adopt(ids, 5, row, 40)
    assert eng._row_owner[row]() is gone and rt.pages.free_rows == before[1]  # no request was made
    rt.pages.shrink([row], [0])
    assert (rt.live_slots(), rt.pages.free_rows, rt.pages.mapped[row]) == before  # nothing was taken
    # the caller maps (and would write) the pages: the same adopt is taken
    rt.pages.ensure([row], [40], [40 - r])
    req = eng.adopt(ids, 5, row, 40)
    assert req.seq_len == 40 and torch.equal(req.tokens, ids) and req.row == row
    eng.release(req)
    assert rt.live_slots() == before[0]


def test_prefill_hidden_rows():
    eng = engine_for(small_model(), topk=1, steps=3, nodes=4)
    p = prompt(12, 2)
    assert eng.prefill(p, hidden_rows=0).new_hidden.shape[0] == 0
    assert eng.prefill(p, hidden_rows=3).new_hidden.shape[0] == 3
    assert eng.prefill(p, hidden_rows=100).new_hidden.shape[0] == 11  # every committed row
    for bad in (-3, 2.5, True, "4"):
        with pytest.raises(dt.InputError, match="hidden_rows"):
            eng.prefill(p, hidden_rows=bad)
    gc.collect()
    assert eng.runtime.pages.free_rows == 16  # refused calls admitted nothing


def test_a_dropped_request_leaves_no_drafter_state():
    eng = dt.Engine(mtp_model(), dt.SpecConfig(eagle_topk=2, num_steps=2, num_draft_tokens=5))
    drafter = resolve_drafter(eng, "mtp")
    req = eng.prefill(prompt(9, 1))
    drafter.draft(eng, [req])
    assert req.request_id in drafter.caches
    kept = eng.prefill(prompt(9, 2))
    drafter.draft(eng, [kept])
    del req
    gc.collect()
    assert list(drafter.caches) == [kept.request_id]  # the dropped one's draft cache went with it
    assert eng.runtime.live_slots()["token"] == 1


def test_engine_keeps_no_verify_output_after_generate():
    eng = engine_for(small_model(), topk=4, steps=5, nodes=12)
    eng.generate(prompt(10, 1), 8, progress=False)
    assert eng._last is None
    req = eng.prefill(prompt(10, 2))
    tree, out, accs = _round(eng, req, 1)
    eng.commit([req], accs)  # commit without `out` still takes the latest accepted one
    assert eng._last is None  # and lets it go


def test_draft_tree_owns_its_tensors():
    tokens, parents = torch.tensor([5, 6, 7]), torch.tensor([-1, 0, 1])
    tree = dt.DraftTree(tokens, parents)
    tokens[1:] = torch.tensor([487, 382])
    parents[2] = 0
    assert tree.tokens.tolist() == [5, 6, 7] and tree.parents.tolist() == [-1, 0, 1]


def test_editing_the_callers_tensors_after_verify_commits_what_was_verified():
    eng = engine_for(small_model(), topk=1, steps=3, nodes=4)
    p = prompt(10, 3)
    req = eng.prefill(p)
    tokens = torch.tensor([req.root_token, 5, 6, 7])
    tree = dt.DraftTree.chain(tokens)
    out = eng.verify([req], [tree])
    tokens[1:] = torch.tensor([487, 382, 233])
    acc = dt.Acceptance((0, 1, 2, 3), 9, req.request_id, out.verify_id)
    eng.commit([req], [acc], out)
    assert req.tokens[-4:].tolist() == [int(p[-1]), 5, 6, 7]
    assert_same_state(eng, req, serial_decode(eng, p, [5, 6, 7, 9]), "commit of the verified tokens")
