"""DSpark tree node values (budget/node_values.py, value_events.py): the prior and the fitted g
against hand computations, values multiplied along each candidate's path, accept events labelled
from the emitted tokens, the logistic fit recovering known weights, and budgeted trees that change
when the confidence head is read upside down (c -> 1 - c)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import dsv4_tree as dt
from dsv4_tree.checkpoint.dspark import DSparkSettings
from dsv4_tree.checkpoint.tiny import random_dspark
from dsv4_tree.drafters.base import TreeShape
from dsv4_tree.budget.cost_table import LineTable
from dsv4_tree.drafters.dspark import DSparkDrafter
from dsv4_tree.drafters.dspark_tree import MarkovExpansion
from dsv4_tree.budget.node_values import ValueModel, fit_logistic, pool_values, prior_share
from dsv4_tree.budget.value_events import ValueLearner, _Draft, events


def test_prior_shares_against_a_hand_computation():
    probs = torch.tensor([[0.6, 0.3, 0.1], [0.5, 0.25, 0.25]], dtype=torch.float64)
    conf = torch.tensor([0.8, 0.3], dtype=torch.float64)
    # rank 0: c; rank j: (1 - c) p_j / (1 - p_0)
    want = [[0.8, 0.2 * 0.3 / 0.4, 0.2 * 0.1 / 0.4], [0.3, 0.7 * 0.25 / 0.5, 0.7 * 0.25 / 0.5]]
    want = torch.tensor(want, dtype=torch.float64)
    assert torch.allclose(prior_share(probs, conf), want, rtol=0, atol=1e-12)
    assert torch.allclose(ValueModel().share(probs, conf), want, rtol=0, atol=1e-12)


def test_fitted_shares_against_a_hand_computation():
    w = (0.1, 0.5, -0.2, 0.3, 0.4)
    logit = lambda x: math.log(x / (1 - x))  # noqa: E731
    sig = lambda z: 1 / (1 + math.exp(-z))  # noqa: E731
    for (p, c) in (((0.6, 0.3, 0.1), 0.8), ((0.9, 0.05, 0.05), 0.99)):
        prior = [c] + [(1 - c) * q / (1 - p[0]) for q in p[1:]]
        g = [sig(w[0] + w[1] * logit(pr) + w[2] * logit(c) + w[3] * math.log(q) + w[4] * (j == 0))
             for j, (pr, q) in enumerate(zip(prior, p))]
        g = [x / max(1.0, sum(g)) for x in g]  # siblings share at most 1
        got = ValueModel(w).share(torch.tensor([p], dtype=torch.float64), torch.tensor([c], dtype=torch.float64))
        assert got[0].tolist() == pytest.approx(g, rel=1e-9)


def _hand_expansion() -> MarkovExpansion:
    """topk 2, three depths, one request; depth 3's frontier is pool ids 2 and 4."""
    f = lambda *x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
    return MarkovExpansion(
        score_list=[], token_list=[torch.tensor([[10, 11]]), torch.tensor([[20, 21, 22, 23]]), torch.tensor([[30, 31, 32, 33]])],
        parents_list=[torch.tensor([[-1, 0, 1]]), torch.tensor([[2, 4]])],
        prob_list=[f([[[0.7, 0.2]]]), f([[[0.6, 0.3], [0.5, 0.4]]]), f([[[0.9, 0.05], [0.6, 0.2]]])],
        confidence_list=[f([0.9]), f([[0.8, 0.4]]), f([[0.95, 0.5]])])


def test_values_multiply_the_shares_along_each_path():
    pool = pool_values(_hand_expansion(), ValueModel(), 2)
    v1 = [0.9, 0.1 * 0.2 / 0.3]
    v2 = [v1[0] * 0.8, v1[0] * 0.2 * 0.3 / 0.4, v1[1] * 0.4, v1[1] * 0.6 * 0.4 / 0.5]
    v3 = [v2[0] * 0.95, v2[0] * 0.05 * 0.05 / 0.1, v2[2] * 0.5, v2[2] * 0.5 * 0.2 / 0.4]
    assert pool.values[0].tolist() == pytest.approx(v1 + v2 + v3, rel=1e-6)
    assert pool.parents[0].tolist() == [-1, -1, 0, 0, 1, 1, 2, 2, 4, 4]
    assert pool.depths.tolist() == [1, 1, 2, 2, 2, 2, 3, 3, 3, 3]
    flipped = _hand_expansion()
    flipped.confidence_list = [1 - c for c in flipped.confidence_list]
    assert pool_values(flipped, ValueModel(), 2).values[0, 0] == pytest.approx(0.1)


def test_events_label_the_candidates_the_accepted_path_reached():
    tokens = np.array([10, 11, 20, 21, 22, 23])
    parents, depths = np.array([-1, -1, 0, 0, 1, 1]), np.array([1, 1, 2, 2, 2, 2])
    feats = np.arange(6, dtype=np.float64)[:, None]
    x, y = events(tokens, parents, depths, feats, [10, 21, 5])  # 10 then 21 accepted, bonus 5
    assert x[:, 0].tolist() == [0, 1, 2, 3] and y.tolist() == [1, 0, 0, 1]
    x, y = events(tokens, parents, depths, feats, [11])  # nothing accepted, bonus 11: depth 2 unknown
    assert x[:, 0].tolist() == [0, 1] and y.tolist() == [0, 1]


def test_the_logistic_fit_recovers_known_weights():
    rng = np.random.default_rng(0)
    x = np.column_stack([np.ones(6000), rng.normal(size=(6000, 3))])
    w = np.array([-0.5, 1.5, -1.0, 0.7])
    y = (rng.random(6000) < 1 / (1 + np.exp(-x @ w))).astype(np.float64)
    assert np.abs(fit_logistic(x, y, l2=1e-3) - w).max() < 0.15


def test_budgeted_trees_change_when_the_confidence_is_read_upside_down(monkeypatch):
    model = dt.load_model(dt.tiny_checkpoint())
    module = random_dspark(model.config, DSparkSettings(4, 8, model.vocab_size - 5, (1, 2, 3)), seed=4)
    spec = dt.SpecConfig(eagle_topk=3, num_steps=4, num_draft_tokens=8, max_requests=8)
    table = LineTable((1, 8), (1.0, 1.0), (0.02, 0.02))  # a node is worth verifying at value > ~0.1
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 500, (12 + 5 * i,), generator=g).tolist() for i in range(8)]

    eng = dt.Engine(model, spec)
    eng.register_drafter(DSparkDrafter(model, TreeShape.from_spec(spec), module=module))  # the feature layers
    reqs = eng.prefill_batch(prompts)

    def trees():  # a fresh drafter: the prior values, no history
        drafter = DSparkDrafter(model, TreeShape.from_spec(spec), module=module, cost_table=table, values=ValueModel())
        return [(t.tokens.tolist(), t.parents.tolist()) for t in drafter.draft(eng, reqs)]

    right = trees()
    assert right == trees()
    real = module.confidence_of
    monkeypatch.setattr(module, "confidence_of", lambda h, prev, temperature=None: 1 - real(h, prev, temperature))
    flipped = trees()
    assert sum(a != b for a, b in zip(right, flipped)) >= 6, (right, flipped)


def test_sampled_first_tokens_on_budgeted_trees_with_fitted_values_follow_the_target():
    """The shipped DSpark, a fitted g and a cost table: 32 copies each of two prompts share one
    budget, so the two prompts' requests get trees of different sizes and shapes; the first token
    verify emits on them follows each prompt's target (values are draw-independent: the trees are
    fixed before verify's draws)."""
    from dsv4_tree.train.corpus import heldout_prompt
    from test_adaptive_sampling import chi2_p

    trained = dt.load_model(dt.trained_checkpoint())
    spec = dt.SpecConfig(eagle_topk=4, num_steps=3, num_draft_tokens=8, max_requests=64, accept="sampling")
    eng = dt.Engine(trained, spec)
    drafter = DSparkDrafter(trained, TreeShape.from_spec(spec), size="adaptive",
                            values=ValueModel((0.2, 0.8, 0.3, 0.2, 0.5)), cost_table=LineTable((1, 64), (1.0, 1.0), (0.004, 0.004)))
    eng.register_drafter(drafter)
    g = torch.Generator().manual_seed(0)
    drafter.set_sampling(1.0, 1.0, g)
    prompts = (heldout_prompt(40, 5), heldout_prompt(40, 3))
    reqs = eng.prefill_batch([prompts[i % 2] for i in range(64)])
    targets = [dt.verify.sampling.target_probs(
        eng.verify([r], [dt.DraftTree.chain([r.root_token])]).logits[0][0], 1.0) for r in reqs[:2]]
    counts = torch.zeros(2, trained.vocab_size, dtype=torch.float64)
    sizes, in_tree = [set(), set()], 0
    for _ in range(30):
        trees = drafter.draft(eng, reqs)
        out = eng.verify(reqs, trees)
        for i, (tree, acc) in enumerate(zip(trees, eng.accept_sampling(reqs, trees, out, 1.0, 1.0, g))):
            sizes[i % 2].add(tree.num_nodes)
            counts[i % 2, int(tree.tokens[acc.path[1]]) if len(acc.path) > 1 else acc.bonus] += 1
            in_tree += len(acc.path) > 1
    assert sizes[0] != sizes[1] and max(min(s) for s in sizes) < spec.num_draft_tokens, sizes  # the budget shapes them
    assert in_tree > 0.2 * counts.sum(), "the trees must hold the target's token often enough for this test to bite"
    assert min(chi2_p(c, t) for c, t in zip(counts, targets)) > 1e-3


def test_a_confident_request_gets_a_deep_spine_and_an_unsure_one_siblings():
    """Two requests, the same draft probabilities (0.6, 0.3 for every parent's two children), one
    budget of 6 nodes: confidence 0.95 everywhere makes request 0's rank-0 children worth nearly
    their parents (a spine three deep), confidence 0.3 makes request 1's rank-1 child outvalue
    its rank-0 sibling (both taken). Values from the prior, picks from verify_budget."""
    from dsv4_tree.budget.verify_budget import eligible, pick_nodes

    f = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
    probs = [f([[[0.6, 0.3]]] * 2), f([[[0.6, 0.3], [0.6, 0.3]]] * 2), f([[[0.6, 0.3], [0.6, 0.3]]] * 2)]
    conf = [f([0.95, 0.3]), f([[0.95, 0.95], [0.3, 0.3]]), f([[0.95, 0.95], [0.3, 0.3]])]
    exp = MarkovExpansion(score_list=[], token_list=[torch.zeros(2, 2), torch.zeros(2, 4), torch.zeros(2, 4)],
                          parents_list=[torch.tensor([[-1, 0, 1]] * 2), torch.tensor([[2, 4], [4, 2]])],
                          prob_list=probs, confidence_list=conf)
    pool = pool_values(exp, ValueModel(), 2)
    chosen = pick_nodes(eligible(pool.values, pool.depths, 7), tuple(pool.values.shape), 6)
    ids = [chosen[r].nonzero().flatten().tolist() for r in range(2)]
    assert ids[0] == [0, 2, 6], (ids, pool.values)  # depth 1, 2, 3: each the rank-0 child of the one before
    assert ids[1][:2] == [0, 1] and len(ids[1]) == 3, (ids, pool.values)  # both of the root's children
    flipped = MarkovExpansion([], exp.token_list, exp.parents_list, probs, [1 - c for c in conf])
    pool = pool_values(flipped, ValueModel(), 2)
    chosen = pick_nodes(eligible(pool.values, pool.depths, 7), tuple(pool.values.shape), 6)
    assert [chosen[r].nonzero().flatten().tolist() for r in range(2)] != ids  # read upside down: other trees


def test_batch_events_are_each_requests_events_in_order():
    from dsv4_tree.budget.value_events import batch_events

    rng = np.random.default_rng(1)
    depths = np.array([1, 1, 2, 2, 2, 2, 3, 3])
    parents = np.array([[-1, -1, 0, 0, 1, 1, 2, 3], [-1, -1, 1, 1, 0, 0, 4, 5], [-1, -1, 0, 1, 0, 1, 3, 2]])
    tokens = rng.integers(0, 3, size=(3, 8))
    feats = rng.normal(size=(3, 8, 2))
    emitted = [[int(tokens[0, 0]), int(tokens[0, 2]), 1, 2], [int(tokens[1, 1])], [2, 0]]
    x, y = batch_events(tokens, parents, depths, feats, emitted)
    want = [events(tokens[i], parents[i], depths, feats[i], emitted[i]) for i in range(3)]
    assert np.array_equal(x, np.concatenate([w[0] for w in want])) and np.array_equal(y, np.concatenate([w[1] for w in want]))
    assert 0 < y.sum() < len(y)


def test_the_learners_payload_unpacks_to_the_pool():
    """What the draft's read brings the value learner (ValueLearner.payload, float64 columns)
    unpacks on the host to the pool's tokens, parents, features and depths, exactly."""
    from dsv4_tree.budget.node_values import PoolValues

    g = torch.Generator().manual_seed(1)
    b, p, f = 3, 6, 5
    tokens = torch.randint(0, 260, (b, p), generator=g)
    parents = torch.randint(-1, p, (b, p), generator=g)
    feats = torch.randn(b, p, f, dtype=torch.float64, generator=g)
    depths = torch.tensor([1, 1, 2, 2, 3, 3])
    payload = ValueLearner().payload(tokens, PoolValues(torch.rand(b, p, dtype=torch.float64), depths, parents, feats))
    d = _Draft.unpack([10, 11, 12], [5, 6, 7], payload.numpy())
    assert (d.tokens == tokens.numpy()).all() and (d.parents == parents.numpy()).all()
    assert (d.depths == depths.numpy()).all() and d.features.tobytes() == feats.numpy().tobytes()
    assert ValueLearner(learn=False).payload(tokens, None) is None
