"""Bad input raises a specific dsv4_tree exception and leaves committed state unchanged."""
import pytest
import torch

import dsv4_tree as dt
from cases import deep_chain_tree, engine_for, prompt, random_tree, small_model
from cases import snapshot as state_of


def snapshot(eng, req):
    state = [(k, v.clone()) for layer in state_of(eng, req) for k, v in layer.items()]
    return req.seq_len, req.root_token, req.tokens.clone(), state


def assert_unchanged(eng, req, snap):
    seq_len, root, tokens, state = snap
    assert req.seq_len == seq_len and req.root_token == root and torch.equal(req.tokens, tokens)
    now = [(k, v) for layer in state_of(eng, req) for k, v in layer.items()]
    assert [k for k, _ in now] == [k for k, _ in state]
    for (k, a), (_, b) in zip(now, state):
        assert torch.equal(a, b), k


@pytest.mark.parametrize(
    "tokens,parents,match",
    [
        ([1, 2, 3], [-1, 0, 2], r"parents\[2\]"),  # parent not earlier
        ([1, 2, 3], [0, 0, 1], r"parents\[0\]"),  # root parent
        ([1, 2], [-1, 5], r"parents\[1\]"),
        ([], [], "at least one node"),
        ([1, 2], [-1], "differ"),
        ([1, -4], [-1, 0], "negative"),
    ],
)
def test_malformed_tree(tokens, parents, match):
    with pytest.raises(dt.TreeError, match=match):
        dt.DraftTree(torch.tensor(tokens, dtype=torch.int64), torch.tensor(parents, dtype=torch.int64))


def test_tree_dtype_and_shape():
    with pytest.raises(dt.TreeError, match="int64"):
        dt.DraftTree(torch.tensor([1.0, 2.0]), torch.tensor([-1, 0]))
    with pytest.raises(dt.TreeError, match="1-D"):
        dt.DraftTree(torch.tensor([[1, 2]]), torch.tensor([[-1, 0]]))


@pytest.fixture()
def setup():
    model = small_model()
    eng = engine_for(model, topk=4, steps=6, nodes=16)
    req = eng.prefill(prompt(12, 1))
    return model, eng, req


def test_token_out_of_vocab(setup):
    _, eng, req = setup
    snap = snapshot(eng, req)
    tree = dt.DraftTree(torch.tensor([req.root_token, 600]), torch.tensor([-1, 0]))
    with pytest.raises(dt.InputError, match="600 outside the vocabulary"):
        eng.verify([req], [tree])
    assert_unchanged(eng, req, snap)
    with pytest.raises(dt.InputError, match="vocabulary"):
        eng.prefill([1, 2, 9999])


def test_prompt_errors(setup):
    _, eng, _ = setup
    with pytest.raises(dt.InputError, match="empty"):
        eng.prefill([])
    with pytest.raises(dt.InputError, match="max_position_embeddings=512"):
        eng.prefill(torch.full((600,), 3))
    with pytest.raises(dt.InputError, match="integer"):
        eng.prefill(torch.tensor([1.0, 2.0]))


def test_lists_of_different_length(setup):
    _, eng, req = setup
    snap = snapshot(eng, req)
    tree = deep_chain_tree(req.root_token, 2, 0)
    with pytest.raises(dt.InputError, match="1 requests but 2 trees"):
        eng.verify([req], [tree, tree])
    with pytest.raises(dt.InputError, match="at least one request"):
        eng.verify([], [])
    with pytest.raises(dt.InputError, match="twice"):
        eng.verify([req, req], [tree, tree])
    assert_unchanged(eng, req, snap)


def test_tree_limits_and_root(setup):
    _, eng, req = setup
    snap = snapshot(eng, req)
    with pytest.raises(dt.InputError, match="num_draft_tokens allows 16"):
        eng.verify([req], [random_tree(req.root_token, 20, 3, 6, 1)])
    with pytest.raises(dt.InputError, match="num_steps allows 6"):
        eng.verify([req], [deep_chain_tree(req.root_token, 7, 1)])
    with pytest.raises(dt.InputError, match="pending root token"):
        eng.verify([req], [deep_chain_tree((req.root_token + 1) % 500, 2, 1)])
    with pytest.raises(dt.InputError, match="DraftTree"):
        eng.verify([req], [[req.root_token, 2]])
    assert_unchanged(eng, req, snap)


def test_positions_past_model_limit():
    model = small_model()
    eng = engine_for(model, topk=1, steps=12, nodes=13)
    req = eng.prefill(prompt(505, 2))
    snap = snapshot(eng, req)
    with pytest.raises(dt.InputError, match="max_position_embeddings=512"):
        eng.verify([req], [deep_chain_tree(req.root_token, 10, 1)])
    assert_unchanged(eng, req, snap)


def test_bad_commits_leave_state_unchanged(setup):
    _, eng, req = setup
    other = eng.prefill(prompt(20, 2))
    snaps = [snapshot(eng, req), snapshot(eng, other)]
    trees = [random_tree(req.root_token, 10, 4, 3, 5), random_tree(other.root_token, 10, 4, 3, 6)]
    out = eng.verify([req, other], trees)
    accs = eng.accept_greedy([req, other], trees, out)
    bad_path = dt.Acceptance((0, 9, 3), 4, other.request_id, out.verify_id)  # not a path
    with pytest.raises(dt.InputError, match="not a root-to-node path"):
        eng.commit([req, other], [accs[0], bad_path], out)
    for nodes in ((0, 99), (0, -1), (0, -9)):  # out of range, and negative ids (never Python's wrap-around)
        with pytest.raises(dt.InputError, match="not a root-to-node path"):
            eng.commit([req, other], [accs[0], dt.Acceptance(nodes, 4, other.request_id, out.verify_id)], out)
    with pytest.raises(dt.InputError, match="1 acceptances"):
        eng.commit([req, other], accs[:1], out)
    with pytest.raises(dt.InputError, match="vocabulary"):
        eng.commit([req, other], [accs[0], dt.Acceptance((0,), 10**6, other.request_id, out.verify_id)], out)
    for r, s in zip((req, other), snaps):
        assert_unchanged(eng, r, s)
    eng.commit([req, other], accs, out)  # still usable
    with pytest.raises(dt.StateError, match="committed since"):
        eng.commit([req, other], accs, out)  # stale: already committed


def test_verify_does_not_mutate(setup):
    _, eng, req = setup
    snap = snapshot(eng, req)
    eng.verify([req], [random_tree(req.root_token, 16, 6, 4, 8)])
    assert_unchanged(eng, req, snap)


def test_accept_refuses_a_verified_tree_whose_root_was_edited_in_place(setup):
    _, eng, req = setup
    tree = random_tree(req.root_token, 6, 3, 2, 9)
    out = eng.verify([req], [tree])
    tree.tokens[0] = (req.root_token + 1) % 512
    with pytest.raises(dt.InputError, match="root token"):
        eng.accept_greedy([req], [tree], out)
