"""Greedy acceptance on the device (verify/accept_batch.py) equals the per-tree host walk, at a
fixed shape without a host read; TreeBatch's one read gives DraftTree.made trees."""
import random

import torch

from dsv4_tree.diagnostics import HostReadCounter, forbid_host_sync
from dsv4_tree.tree.draft_tree import DraftTree
from dsv4_tree.tree.tree_batch import TreeBatch
from dsv4_tree.verify.accept import greedy_walk
from dsv4_tree.verify.accept_batch import greedy_accept

VOCAB = 4  # a small vocabulary: siblings share tokens and targets match often


def _random_tree(rng: random.Random, n: int) -> DraftTree:
    parents = [-1] + [rng.randrange(i) for i in range(1, n)]
    return DraftTree.from_lists([rng.randrange(VOCAB) for _ in range(n)], parents)


def test_the_batched_walk_equals_the_host_walk_on_random_trees():
    rng = random.Random(0)
    for trial in range(60):
        trees = [_random_tree(rng, rng.randint(1, 12)) for _ in range(rng.randint(1, 6))]
        batch = TreeBatch.from_trees(trees)
        n = batch.tokens.shape[1]
        target = torch.randint(0, VOCAB, (len(trees), n), generator=torch.Generator().manual_seed(trial))
        with forbid_host_sync():
            acc = greedy_accept(batch.tokens, batch.parents, target, batch.counts)
        for b, tree in enumerate(trees):
            path, bonus = greedy_walk(tree, target[b, : tree.num_nodes].tolist())
            k = int(acc.lengths[b])
            assert acc.path[b, : k + 1].tolist() == path and int(acc.bonus[b]) == bonus, (trial, b)
            assert (acc.path[b, k + 1 :] == -1).all()


def test_a_depth_bound_walks_that_many_steps():
    chain = DraftTree.chain([1, 2, 3, 4])
    batch = TreeBatch.from_trees([chain])
    target = torch.tensor([[2, 3, 4, 0]])  # every node is its parent's argmax: all accepted
    assert greedy_accept(batch.tokens, batch.parents, target, batch.counts).path.tolist() == [[0, 1, 2, 3]]
    cut = greedy_accept(batch.tokens, batch.parents, target, batch.counts, max_depth=2)
    assert cut.path.tolist() == [[0, 1, 2]] and cut.bonus.tolist() == [4]


def test_a_tree_batch_is_read_once_into_made_trees():
    tokens = torch.tensor([[7, 1, 2, 0], [8, 3, 4, 5]])
    parents = torch.tensor([[-1, 0, 0, -1], [-1, 0, 1, 1]])
    with HostReadCounter() as reads:
        trees = TreeBatch(tokens, parents, torch.tensor([3, 4])).trees()
        lists = [t.host_lists() for t in trees] + [t.max_depth for t in trees]
    assert reads.total == 1
    assert all(t.is_made for t in trees) and not DraftTree.chain([1]).is_made
    assert lists[:2] == [([7, 1, 2], [-1, 0, 0]), ([8, 3, 4, 5], [-1, 0, 1, 1])] and lists[2:] == [1, 2]
    assert torch.equal(trees[1].depth, torch.tensor([0, 1, 2, 2]))  # the tensor fields agree with the lists
    cut = trees[1].up_to_depth(1)
    assert cut.is_made and cut.host_lists() == ([8, 3], [-1, 0])
    with HostReadCounter() as reads:
        _, extra = TreeBatch(tokens, parents).trees_and(torch.tensor([3.0, 0.125, float("nan")], dtype=torch.float64))
    assert reads.total == 1 and extra[:2] == [3.0, 0.125] and extra[2] != extra[2]
    payload = torch.randn(2, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with HostReadCounter() as reads:  # a payload (the value learner's pool) in the same read, bit for bit
        got, extra, host = TreeBatch(tokens, parents, torch.tensor([3, 4])).trees_with(torch.tensor([2.5]), payload)
    assert reads.total == 1 and [t.host_lists() for t in got] == lists[:2] and extra == [2.5]
    assert host.shape == (2, 7) and host.tobytes() == payload.numpy().tobytes()


def _chi2_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    from test_sampling import chi2_sf

    keep = probs > 0
    exp = counts.sum() * probs[keep]
    return chi2_sf(float(((counts[keep] - exp) ** 2 / exp).sum()), int(keep.sum()) - 1)


def test_batched_sampling_is_lossless_on_a_tree_with_equal_siblings():
    """sample_accept over 20,000 copies of test_sampling's tree (equal-token siblings, children
    at two depths) padded beside a lone root: the first emitted token follows the target's root
    distribution, the second the node it reached, the lone root's bonus its own row."""
    from dsv4_tree.verify.accept_batch import sample_accept
    from dsv4_tree.verify.sampling import target_probs
    from test_sampling import TRIALS, V, tree_and_probs

    tree, logits = tree_and_probs()
    probs = target_probs(logits, temperature=0.8)
    trees = [tree] * TRIALS + [DraftTree.chain([1])] * 2000
    batch = TreeBatch.from_trees(trees)
    p = probs.unsqueeze(0).expand(len(trees), -1, -1).contiguous()
    with forbid_host_sync():
        acc = sample_accept(batch.tokens, batch.parents, p, batch.counts, 2, torch.Generator().manual_seed(3))
    toks = batch.tokens.gather(1, acc.path.clamp(min=0))
    first = torch.where(acc.lengths >= 1, toks[:, 1], acc.bonus)[:TRIALS]
    assert _chi2_p(torch.bincount(first, minlength=V).double(), probs[0]) > 1e-3
    second = torch.where(acc.lengths >= 2, toks[:, 2], acc.bonus)[:TRIALS]
    for tok, node in ((2, 1), (4, 3)):
        reached = (first == tok) & (acc.lengths[:TRIALS] >= 1)
        assert _chi2_p(torch.bincount(second[reached], minlength=V).double(), probs[node]) > 1e-3
    lone = acc.bonus[TRIALS:]
    assert (acc.lengths[TRIALS:] == 0).all() and _chi2_p(torch.bincount(lone, minlength=V).double(), probs[0]) > 1e-3


def test_batched_sampling_without_sibling_removal_is_detected(monkeypatch):
    """Power check: counting an equal-token sibling twice (the classic bug) fails the same test."""
    from dsv4_tree.verify import accept_batch
    from dsv4_tree.verify.sampling import target_probs
    from test_sampling import TRIALS, V, tree_and_probs

    tree, logits = tree_and_probs()
    probs = target_probs(logits, temperature=0.8)
    batch = TreeBatch.from_trees([tree] * TRIALS)
    p = probs.unsqueeze(0).expand(TRIALS, -1, -1).contiguous()
    monkeypatch.setattr(accept_batch, "counted_before", lambda tokens, parents: torch.zeros_like(tokens, dtype=torch.bool))
    acc = accept_batch.sample_accept(batch.tokens, batch.parents, p, batch.counts, 2, torch.Generator().manual_seed(3))
    toks = batch.tokens.gather(1, acc.path.clamp(min=0))
    first = torch.where(acc.lengths >= 1, toks[:, 1], acc.bonus)
    assert _chi2_p(torch.bincount(first, minlength=V).double(), probs[0]) < 1e-6


def test_children_holding_all_the_mass_take_the_last_child_on_rounding():
    """The target puts all its mass on the children's tokens: r past the rounded sum picks the
    last child with mass (verify/sampling.py's rule), never a bonus from an empty remainder."""
    from dsv4_tree.verify.accept_batch import sample_accept

    tree = DraftTree.from_lists([0, 1, 2], [-1, 0, 0])
    probs = torch.zeros(1, 3, 4, dtype=torch.float64)
    probs[0, 0, 1], probs[0, 0, 2] = 0.25, 0.75
    probs[0, 1:, 3] = 1.0
    batch = TreeBatch.from_trees([tree] * 4000)
    acc = sample_accept(batch.tokens, batch.parents, probs.expand(4000, -1, -1), batch.counts, 1,
                        torch.Generator().manual_seed(0))
    assert (acc.lengths == 1).all() and set(acc.path[:, 1].tolist()) == {1, 2} and (acc.bonus == 3).all()
    share = float((acc.path[:, 1] == 1).double().mean())
    assert abs(share - 0.25) < 4 * (0.25 * 0.75 / 4000) ** 0.5
