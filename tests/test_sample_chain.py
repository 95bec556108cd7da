"""Speculative sampling along a sampled chain (verify/sampling.sample_drawn, the one-child case of
a drawn tree: tests/test_drawn_trees.py has the rest): drafts drawn from
q, accepted with min(1, p/q), residual max(p - q, 0): every emitted token follows the target.
And DraftTree.draft_probs: checked, copied, trimmed with the tree."""
from __future__ import annotations

import pytest
import torch

import dsv4_tree as dt
from dsv4_tree.verify.sampling import sample_drawn, sample_tree
from test_sampling import chi2_sf

V, TRIALS = 6, 12000


def _chi2(counts, probs) -> float:
    exp = counts.sum() * probs
    return chi2_sf(float(((counts - exp) ** 2 / exp).sum()), probs.numel() - 1)


def _distributions(seed):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(3, V, generator=g) * 1.5, -1).double()  # target at nodes 0, 1, 2
    q = torch.softmax(torch.randn(2, V, generator=g) * 1.5, -1).double()  # draft rows for nodes 1, 2
    return p, q


def test_first_two_tokens_follow_the_target():
    """Draw x1 ~ q[0], x2 ~ q[1] (the chain's second draft independent of x1 here; the rule
    needs only that x_i is drawn from q_i), verify: the first token ~ p[0], and given the first
    was x1, the second ~ p[1] (the target row of node 1)."""
    p, q = _distributions(0)
    g = torch.Generator().manual_seed(1)
    first = torch.zeros(V)
    second = torch.zeros(V, V)
    for _ in range(TRIALS):
        x = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(2)]
        tree = dt.DraftTree(torch.tensor([0] + x), torch.tensor([-1, 0, 1]), draft_probs=q)
        path, bonus = sample_drawn(tree, p, g)
        emitted = [int(tree.tokens[i]) for i in path[1:]] + [bonus]
        first[emitted[0]] += 1
        if len(path) > 1:  # the first draft was accepted: the second token came from node 1's row
            second[emitted[0], emitted[1]] += 1
    ps = [_chi2(first, p[0])] + [_chi2(second[t], p[1]) for t in range(V) if second[t].sum() > 200]
    assert min(ps) > 1e-3, ps
    # power: accepting every draft would give q[0], which this test tells apart from p[0]
    assert _chi2(q[0] * TRIALS, p[0]) < 1e-9


def test_a_chain_that_misstates_its_draw_distribution_is_detected():
    """Power check through sample_drawn itself: drafts drawn from q but declared as drawn from
    the target p (a drafter whose draft_probs lie) are always accepted, so the first token
    follows q, and the same chi-square rejects it."""
    p, q = _distributions(2)
    g = torch.Generator().manual_seed(3)
    first = torch.zeros(V)
    for _ in range(TRIALS // 4):
        x = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(2)]
        tree = dt.DraftTree(torch.tensor([0] + x), torch.tensor([-1, 0, 1]), draft_probs=p[:2])
        path, bonus = sample_drawn(tree, p, g)
        first[int(tree.tokens[1]) if len(path) > 1 else bonus] += 1
    assert _chi2(first, p[0]) < 1e-6


def test_sample_tree_dispatches_on_draft_probs():
    p, q = _distributions(4)
    sampled = dt.DraftTree(torch.tensor([0, 5, 5]), torch.tensor([-1, 0, 1]), draft_probs=q)
    fixed = dt.DraftTree(torch.tensor([0, 5, 5]), torch.tensor([-1, 0, 1]))
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert sample_tree(sampled, p, g1) == sample_drawn(sampled, p, g2)
    assert fixed.draft_probs is None


def test_draft_probs_are_checked_copied_and_trimmed():
    q = torch.softmax(torch.randn(3, V), -1)
    tree = dt.DraftTree(torch.tensor([1, 2, 3, 4]), torch.tensor([-1, 0, 1, 2]), draft_probs=q)
    q[0, 0] = 5.0
    assert tree.draft_probs[0, 0] != 5.0, "the tree keeps its own copy"
    cut = tree.up_to_depth(1)
    assert cut.num_nodes == 2 and torch.equal(cut.draft_probs, tree.draft_probs[:1])
    with pytest.raises(dt.TreeError, match="2 rows for 3 non-root nodes"):
        dt.DraftTree(torch.tensor([1, 2, 3, 4]), torch.tensor([-1, 0, 1, 2]), draft_probs=q[:2])
    q = tree.draft_probs
    branched = dt.DraftTree(torch.tensor([1, 2, 3, 4]), torch.tensor([-1, 0, 0, 2]), draft_probs=q)
    cut = branched.up_to_depth(1)  # nodes 0, 1, 2: rows 0 and 1
    assert cut.num_nodes == 3 and torch.equal(cut.draft_probs, branched.draft_probs[:2])
    skip = dt.DraftTree(torch.tensor([1, 2, 3, 4]), torch.tensor([-1, 0, 1, 0]), draft_probs=q).up_to_depth(1)
    assert skip.num_nodes == 3 and torch.equal(skip.draft_probs, q[[0, 2]]), "the kept nodes' rows"
    with pytest.raises(dt.TreeError, match="2-D float tensor"):
        dt.DraftTree(torch.tensor([1, 2]), torch.tensor([-1, 0]), draft_probs=torch.ones(1, V, dtype=torch.int64))
    with pytest.raises(dt.TreeError, match="outside draft_probs' 6 columns"):
        dt.DraftTree(torch.tensor([1, 9]), torch.tensor([-1, 0]), draft_probs=q[:1])
    with pytest.raises(dt.TreeError, match="finite and >= 0"):
        dt.DraftTree(torch.tensor([1, 2]), torch.tensor([-1, 0]), draft_probs=torch.full((1, V), float("nan")))
    with pytest.raises(dt.TreeError, match="must sum to 1"):
        dt.DraftTree(torch.tensor([1, 2]), torch.tensor([-1, 0]), draft_probs=torch.full((1, V), 0.5))
    zero = torch.tensor([[0.5, 0.5, 0.0, 0.0, 0.0, 0.0]])
    with pytest.raises(dt.TreeError, match=r"tokens\[1\]=2 has probability 0"):
        dt.DraftTree(torch.tensor([1, 2]), torch.tensor([-1, 0]), draft_probs=zero)
    with pytest.raises(dt.InputError, match="6 columns, the target's distributions 7"):
        sample_drawn(dt.DraftTree(torch.tensor([1, 0]), torch.tensor([-1, 0]), draft_probs=zero), torch.ones(2, 7) / 7)

