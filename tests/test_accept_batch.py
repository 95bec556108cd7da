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
