"""Chain verify (eagle_topk = 1) through our cache equals per-path Hugging Face runs."""
import pytest
import torch

import dsv4_tree as dt
from cases import PAGE_SIZES, check_against_oracle, deep_chain_tree, engine_for, prompt, small_model

# every residue mod 4, P < W (=8), around multiples of the HCA ratio (=16), and a longer one
P_VALUES = [0, 1, 2, 3, 5, 6, 7, 14, 15, 16, 17, 31, 32, 33, 47, 63, 64]


@pytest.mark.parametrize("P", P_VALUES)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_chain_matches_per_path(P, page_size):
    model = small_model()
    eng = engine_for(model, topk=1, steps=4, nodes=5, page_size=page_size)
    p = prompt(P + 1, seed=P)
    check_against_oracle(model, eng, [p], [deep_chain_tree(int(p[-1]), 4, seed=P)], f"P={P}")


@pytest.mark.parametrize("P", [3, 13, 30])
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_deep_chain_closes_three_c4_blocks(P, page_size):
    model = small_model()
    eng = engine_for(model, topk=1, steps=12, nodes=13, page_size=page_size)
    p = prompt(P + 1, seed=100 + P)
    tree = deep_chain_tree(int(p[-1]), 12, seed=P)
    closing = ((tree.positions(P) + 1) % 4 == 0).sum()
    assert closing >= 3, f"{P=} closes only {closing} C4 blocks"
    check_against_oracle(model, eng, [p], [tree], f"deep chain P={P}")


def test_requests_with_different_P_in_one_call():
    model = small_model()
    eng = engine_for(model, topk=1, steps=6, nodes=7)
    prompts = [prompt(6, 1), prompt(15, 2), prompt(34, 3)]
    trees = [deep_chain_tree(int(p[-1]), d, seed=i) for i, (p, d) in enumerate(zip(prompts, (6, 3, 5)))]
    check_against_oracle(model, eng, prompts, trees, "batch of chains")


def test_chain_mode_rows_equal_the_same_branch_inside_a_tree():
    """A chain verified by a chain-mode engine (eagle_topk=1) against the same tokens as one
    branch of a tree, interleaved with sibling branches, in a tree engine: a different plan
    (sibling entries to hide, other row ids) and other batch sizes, so close, not bitwise (GEMMs
    over a different row count round differently; design_notes/tolerances.md)."""
    model = small_model()
    p = prompt(20, 9)
    chain = deep_chain_tree(int(p[-1]), 5, seed=9)
    chain_eng = engine_for(model, topk=1, steps=5, nodes=6)
    a = chain_eng.verify([chain_eng.prefill(p)], [chain]).logits[0]
    g = torch.Generator().manual_seed(9)
    toks, parents, on_chain = [int(chain.tokens[0])], [-1], [0]
    for i in range(1, 6):  # before each chain node: a sibling branch of two nodes
        toks += torch.randint(2, 512, (2,), generator=g).tolist()
        parents += [on_chain[-1], len(parents)]
        on_chain.append(len(toks))
        toks.append(int(chain.tokens[i]))
        parents.append(on_chain[-2])
    tree = dt.DraftTree.from_lists(toks, parents)
    with pytest.raises(dt.InputError, match="num_draft_tokens allows 6"):
        chain_eng.verify([chain_eng.prefill(p)], [tree])
    tree_eng = engine_for(model, topk=4, steps=12, nodes=64)
    b = tree_eng.verify([tree_eng.prefill(p)], [tree]).logits[0][on_chain]
    assert torch.equal(tree.tokens[on_chain], chain.tokens)
    # rounding only (~1e-6); a sibling entry or key leaking into a chain row moves logits by >1e-2
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-5), f"max diff {float((a - b).abs().max()):.2e}"


def test_shipped_tiny_checkpoint_chain():
    """The shipped config (window 32, ratios 4 and 128) across the 128 boundary."""
    model = dt.load_model(dt.tiny_checkpoint())
    eng = engine_for(model, topk=1, steps=6, nodes=7)
    p = prompt(125, seed=7)  # seeds 5 and 6 have a top-k tie in a committed row
    check_against_oracle(model, eng, [p], [deep_chain_tree(int(p[-1]), 6, seed=7)], "tiny 128 crossing")
