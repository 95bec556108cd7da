"""The host greedy walk used by Engine.accept_greedy equals SGLang's verify_tree_greedy."""
import torch

from cases import random_tree
from dsv4_tree.reference.greedy import ref_greedy_path
from dsv4_tree.verify.accept import greedy_path


def test_greedy_walk_equals_verify_tree_greedy():
    g = torch.Generator().manual_seed(0)
    vocab = 6  # small: children often match the target's argmax, siblings often repeat tokens
    for seed in range(300):
        n = 1 + seed % 24
        tree = random_tree(0, n, max_depth=1 + seed % 9, max_children=1 + seed % 4, seed=seed, dup_siblings=True)
        tree = type(tree)(tree.tokens % vocab, tree.parents)
        logits = torch.randn(tree.num_nodes, vocab, generator=g)
        # plant matches: many nodes' argmax is one of their children's tokens
        for i in range(tree.num_nodes):
            kids = tree.children(i)
            if kids and seed % 3:
                logits[i, int(tree.tokens[kids[-1]])] += 10.0
        assert greedy_path(tree, logits) == ref_greedy_path(tree, logits), f"{seed=} {n=}"
