"""Speculative generation: greedy output equals plain HF greedy decoding; truncation; atomicity."""
import pytest
import torch

import dsv4_tree as dt
from cases import engine_for, prompt, small_model
from dsv4_tree.drafters import NgramDrafter, PlantedDrafter, TreeShape
from dsv4_tree.generate import truncate
from dsv4_tree.model.full_forward import sequence_logits
from cases import snapshot
from test_commit import assert_same_state, serial_decode

NEW = 64


def hf_greedy(model, ids, n):
    seq = torch.as_tensor(ids)
    out = []
    for _ in range(n):
        nxt = int(sequence_logits(model, seq)[-1].argmax())
        out.append(nxt)
        seq = torch.cat([seq, torch.tensor([nxt])])
    return out


@pytest.fixture(scope="module")
def reference():
    model = small_model()
    base = prompt(12, 5)
    ids = base.repeat(3)  # repetitive: the n-gram drafter finds continuations
    return model, ids, hf_greedy(model, ids, NEW)


@pytest.mark.parametrize(
    "topk,steps,nodes,kind",
    [(1, 4, 5, "ngram"), (1, 6, 7, "planted"), (4, 5, 8, "planted"), (4, 6, 16, "ngram"), (4, 8, 32, "planted")],
)
def test_greedy_speculative_equals_hf_greedy(reference, topk, steps, nodes, kind):
    model, ids, want = reference
    eng = engine_for(model, topk=topk, steps=steps, nodes=nodes)
    shape = TreeShape(topk, steps, nodes)
    drafter = NgramDrafter(shape) if kind == "ngram" else PlantedDrafter(model, shape, corrupt=0.3, seed=topk)
    res = eng.generate(ids, NEW, drafter=drafter, progress=False)
    assert res.tokens == want, f"{topk=} {steps=} {nodes=} {kind=}"
    assert sum(res.stats.accept_lengths) == NEW and res.stats.rounds == len(res.stats.accept_lengths)
    if kind == "planted":
        assert res.stats.mean_tokens_per_verify > 1.5  # planted drafts do get accepted


def test_state_after_generate_equals_serial_decode(reference):
    model, ids, want = reference
    eng = engine_for(model, topk=4, steps=6, nodes=16)
    drafter = PlantedDrafter(model, TreeShape(4, 6, 16), corrupt=0.3, seed=1)
    req = eng.prefill(ids)
    emitted = []
    while len(emitted) < 24:
        tree = drafter.draft(eng, [req])[0]
        out = eng.verify([req], [tree])
        acc = eng.accept_greedy([req], [tree], out)[0]
        eng.commit([req], [acc], out)
        emitted += acc.emitted(tree)
        ref = serial_decode(eng, ids, emitted)
        assert_same_state(eng, req, ref, f"after {len(emitted)} tokens")
    assert emitted == want[: len(emitted)]


def test_budget_and_eos_truncate_inside_a_path(reference):
    model, ids, want = reference
    eng = engine_for(model, topk=1, steps=8, nodes=9)
    drafter = PlantedDrafter(model, TreeShape(1, 8, 9), corrupt=0.0, seed=0)
    res = eng.generate(ids, 5, drafter=drafter, progress=False)  # one round accepts 9: cut at 5
    assert res.tokens == want[:5] and res.stats.rounds == 1
    eos = want[3]
    first = want.index(eos)
    res = eng.generate(ids, 20, drafter=drafter, eos_token_id=eos, progress=False)
    assert res.tokens == want[: first + 1]


def test_truncate_commits_consistent_prefix():
    acc = dt.Acceptance((0, 1, 2, 3), 9, 0, 1)
    cut, em, stop = truncate(acc, [5, 6, 7, 9], 2, None)
    assert cut.path == (0, 1) and cut.bonus == 6 and em == [5, 6] and stop
    cut, em, stop = truncate(acc, [5, 6, 7, 9], 10, [7])
    assert cut.path == (0, 1, 2) and cut.bonus == 7 and em == [5, 6, 7] and stop
    same, em, stop = truncate(acc, [5, 6, 7, 9], 4, None)
    assert same is acc and not stop


def test_exception_inside_steps_leaves_request_usable(monkeypatch):
    model = small_model()
    eng = engine_for(model, topk=4, steps=5, nodes=8)
    req = eng.prefill(prompt(20, 3))
    snap = [(k, v.clone()) for layer in snapshot(eng, req) for k, v in layer.items()]
    tree = PlantedDrafter(model, TreeShape(4, 5, 8), seed=2).draft(eng, [req])[0]
    import dsv4_tree.engine as engine_mod
    import dsv4_tree.serving.runtime as runtime_mod

    def boom(*a, **k):
        raise RuntimeError("injected")

    with monkeypatch.context() as m:  # inside verify
        m.setattr(engine_mod, "run_rows", boom)
        with pytest.raises(RuntimeError):
            eng.verify([req], [tree])
    out = eng.verify([req], [tree])
    with monkeypatch.context() as m:  # inside accept
        m.setattr(engine_mod, "greedy_walk", boom)
        with pytest.raises(RuntimeError):
            eng.accept_greedy([req], [tree], out)
    acc = eng.accept_greedy([req], [tree], out)
    with monkeypatch.context() as m:  # inside commit, after computing the moves, before applying
        m.setattr(runtime_mod, "apply_moves", boom)
        with pytest.raises(RuntimeError):
            eng.commit([req], acc, out)
    now = [(k, v) for layer in snapshot(eng, req) for k, v in layer.items()]
    for (k, a), (_, b) in zip(now, snap):
        assert torch.equal(a, b), k
    eng.commit([req], acc, out)  # the same round still commits
    assert req.seq_len == 19 + acc[0].num_accepted + 1


def test_ngram_drafter_builds_trie():
    d = NgramDrafter(TreeShape(2, 3, 6))
    tree = d.draft_one([1, 2, 3, 4, 1, 2, 5, 6, 1], 2)
    # suffix "1 2" occurred twice: continuations (5, 6, 1) and (3, 4, 1) -> two branches
    assert tree.tokens[0] == 2 and tree.num_nodes <= 6
    assert sorted(int(tree.tokens[c]) for c in tree.children(0)) == [3, 5]
    assert NgramDrafter(TreeShape(1, 3, 4)).draft_one([7, 8, 9], 10).num_nodes == 1  # nothing found
