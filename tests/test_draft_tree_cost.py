"""DraftTree construction is linear for chains (prefill chunks) and never builds an N x N
matrix product; the lazily derived tensors equal their definitions."""
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import dsv4_tree as dt
import dsv4_tree.tree.draft_tree as draft_tree_mod
from cases import random_tree, spine_tree


class ElementCount(TorchDispatchMode):
    """Counts tensor elements read and written by every torch op run inside it: a
    deterministic measure of work (an N x N intermediate alone counts N^2)."""

    def __init__(self):
        super().__init__()
        self.elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten((args, kwargs, out))[0]:
            if isinstance(t, torch.Tensor):
                self.elements += t.numel()
        return out


def chain_work(n: int) -> int:
    """Elements touched building a chain of n tokens and reading what prefill reads besides
    the plan (depth, max_depth, positions, leaves, is_chain)."""
    tokens = torch.arange(n)
    with ElementCount() as count:
        tree = dt.DraftTree.chain(tokens)
        tree.positions(5), tree.max_depth, tree.leaves, tree.is_chain()
    return count.elements


def test_chain_construction_is_linear(monkeypatch):
    def quadratic(*args, **kwargs):
        raise AssertionError("ancestor_matrix (an N x N closure) called while building a DraftTree")

    monkeypatch.setattr(draft_tree_mod, "ancestor_matrix", quadratic)
    small, large = 2048, 16384
    work_small, work_large = chain_work(small), chain_work(large)
    # linear: the ratio is 8 and the work a few dozen elements per token; an N x N step would
    # make the ratio 64 and the work thousands of elements per token
    assert work_large / work_small < 9, f"{work_small=} {work_large=}: super-linear"
    assert work_large < 64 * large, f"{work_large=} elements for {large} tokens"
    tree = dt.DraftTree.chain(torch.arange(large))
    assert "path" not in vars(tree) and "ancestors" not in vars(tree)  # nothing N x N built yet
    assert tree.max_depth == large - 1 and tree.leaves.tolist() == [large - 1]
    # and the wall time agrees (medians; generous, timings share the machine)
    ratio = chain_seconds(large) / chain_seconds(small)
    assert ratio < 24, f"16K/2K chain construction time ratio {ratio:.1f} (linear: <= 8, quadratic: 64)"


def chain_seconds(n: int, reps: int = 9) -> float:
    tokens = torch.arange(n)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        tree = dt.DraftTree.chain(tokens)
        tree.positions(5), tree.max_depth, tree.leaves, tree.is_chain()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def reference_derived(tree):
    """depth, path, ancestors, leaves straight from their definitions (walk the parents)."""
    n = tree.num_nodes
    parents = tree.parents.tolist()
    chains = []
    for i in range(n):
        walk = [i]
        while parents[walk[-1]] >= 0:
            walk.append(parents[walk[-1]])
        chains.append(walk[::-1])
    depth = torch.tensor([len(c) - 1 for c in chains])
    path = torch.full((n, int(depth.max()) + 1), -1, dtype=torch.int64)
    anc = torch.zeros(n, n, dtype=torch.bool)
    for i, c in enumerate(chains):
        path[i, : len(c)] = torch.tensor(c)
        anc[i, c] = True
    leaves = torch.tensor([i for i in range(n) if i not in parents])
    return depth, path, anc, leaves


def test_derived_tensors_match_definitions():
    trees = [random_tree(3, n, d, k, s) for s, (n, d, k) in enumerate([(1, 0, 1), (9, 3, 3), (30, 8, 2), (64, 12, 6)])]
    trees += [spine_tree(3, 40, 12, 3, 5), dt.DraftTree.chain(torch.arange(17)),
              dt.DraftTree.from_lists([1, 2, 3, 4], [-1, 0, 0, 0])]
    for t in trees:
        depth, path, anc, leaves = reference_derived(t)
        label = f"N={t.num_nodes} parents={t.parents.tolist()}"
        assert torch.equal(t.depth, depth), label
        assert torch.equal(t.path, path), label
        assert torch.equal(t.ancestors, anc), label
        assert torch.equal(t.leaves, leaves), label
        assert t.is_chain() == bool((t.parents == torch.arange(t.num_nodes) - 1).all()), label
