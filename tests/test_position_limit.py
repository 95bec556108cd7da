"""Generation up to max_position_embeddings: a draft node's slot is P + its node index while its
position is P + depth, so the page table is sized in slots, and trees are trimmed to the nodes
that can still be emitted (generate.fit_tree)."""
import functools

import pytest
import torch

import dsv4_tree as dt
from cases import prompt
from dsv4_tree.drafters import NgramDrafter, PlantedDrafter, TreeShape
from dsv4_tree.generate import fit_tree
from dsv4_tree.checkpoint.tiny import random_model
from test_generate import hf_greedy

LIMIT = 64


@functools.lru_cache(maxsize=None)
def limited_model():
    cfg = dt.tiny_config(sliding_window=8, compress_rates={"heavily_compressed_attention": 16}, index_topk=3,
                         max_position_embeddings=LIMIT)
    return dt.load_model(random_model(cfg))


def _engine(model):
    return dt.Engine(model, dt.SpecConfig(eagle_topk=4, num_steps=2, num_draft_tokens=8, page_size=16, max_requests=4))


@pytest.mark.parametrize("kind", ["ngram", "planted"])
def test_generate_reaches_the_last_position(kind):
    model = limited_model()
    eng = _engine(model)
    ids = prompt(10, 3).repeat(5)  # 50 tokens: the 14 new ones end at position 63, the last one
    shape = TreeShape(4, 2, 8)
    drafter = NgramDrafter(shape) if kind == "ngram" else PlantedDrafter(model, shape, corrupt=0.2, seed=2)
    new = LIMIT - ids.numel()
    res = eng.generate(ids, new, drafter=drafter, progress=False)
    assert res.tokens == hf_greedy(model, ids, new), kind
    assert res.stop_reason == "length"
    with pytest.raises(dt.InputError, match="max_position_embeddings=64"):
        eng.generate(ids, new + 1, drafter=drafter, progress=False)
    assert eng.runtime.live_slots() == {"token": 0, "recent": 0}


def test_generate_batch_near_the_limit_equals_generate():
    model = limited_model()
    eng = _engine(model)
    prompts = [prompt(50, 1), prompt(61, 2), prompt(30, 3)]
    budgets = [LIMIT - p.numel() for p in prompts]
    drafter = PlantedDrafter(model, TreeShape(4, 2, 8), corrupt=0.2, seed=5)
    got = eng.generate_batch(prompts, budgets, drafter=drafter, progress=False)
    for p, n, g in zip(prompts, budgets, got):
        assert g.tokens == hf_greedy(model, p, n)
    with pytest.raises(dt.InputError, match=r"max_new_tokens\[1\]"):
        eng.generate_batch(prompts, [1, 4, 1], drafter=drafter, progress=False)


def test_a_wide_tree_at_the_last_positions_verifies():
    """8 nodes of depth <= 1 at P = 62: slots run to P + 7 = 69, past the 64 positions."""
    model = limited_model()
    eng = _engine(model)
    p = prompt(63, 4)
    req = eng.prefill(p)
    tree = dt.DraftTree.from_lists([int(p[-1])] + list(range(2, 9)), [-1] + [0] * 7)
    out = eng.verify([req], [tree])
    want = dt.reference.per_path_logits(model, p[:-1], tree)
    assert dt.reference.relative_error(out.logits[0], want) < 1e-4
    deep = dt.DraftTree.chain([int(p[-1]), 5, 6])
    with pytest.raises(dt.InputError, match="reaches position 64"):
        eng.verify([req], [deep])


def test_fit_tree_keeps_the_emittable_nodes():
    tree = dt.DraftTree.from_lists([9, 1, 2, 3, 4, 5], [-1, 0, 1, 0, 2, 3])
    assert fit_tree(tree, 4) is tree  # its depth-3 path emits 4 tokens: all fit
    two = fit_tree(tree, 2)  # depth <= 1
    assert two.tokens.tolist() == [9, 1, 3] and two.parents.tolist() == [-1, 0, 0]
    one = fit_tree(tree, 1)
    assert one.tokens.tolist() == [9] and one.parents.tolist() == [-1]
    mid = fit_tree(tree, 3)
    assert mid.tokens.tolist() == [9, 1, 2, 3, 5] and mid.parents.tolist() == [-1, 0, 1, 0, 3]
    assert torch.equal(mid.depth, torch.tensor([0, 1, 2, 1, 2]))
