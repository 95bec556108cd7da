"""Tree verify equals per-path Hugging Face runs for every node."""
import pytest
import torch

from cases import PAGE_SIZES, check_against_oracle, engine_for, prompt, random_tree, small_model, spine_tree

TREE_CASES = [
    # (P, N, depth limit, max_children, seed); random growth reaches depth <= 9 here, the
    # depth-12 branching trees are below
    (0, 8, 3, 3, 1),
    (2, 16, 6, 6, 2),
    (7, 20, 5, 2, 3),  # P < W
    (8, 24, 8, 3, 4),  # root closes nothing; C4 overlap half from stored state
    (11, 12, 5, 4, 5),  # root closes a C4 block
    (15, 30, 7, 3, 6),  # root closes a C4 and an HCA block
    (12, 40, 12, 2, 7),  # HCA block closed inside the tree, several C4 blocks per path
    (29, 64, 12, 6, 8),  # the largest: N=64, branching up to 6
    (33, 48, 10, 4, 9),
    (46, 32, 6, 5, 10),
]


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("P,N,depth,kids,seed", TREE_CASES)
def test_random_tree_matches_per_path(P, N, depth, kids, seed, page_size):
    model = small_model()
    eng = engine_for(model, page_size=page_size)
    p = prompt(P + 1, seed)
    tree = random_tree(int(p[-1]), N, depth, kids, seed, dup_siblings=seed % 2 == 0)
    check_against_oracle(model, eng, [p], [tree], f"{P=} {N=} {depth=} {kids=} {seed=} {page_size=}")


@pytest.mark.parametrize("P,N,kids,seed", [(12, 40, 3, 11), (29, 64, 4, 12), (5, 24, 2, 13)])
def test_branching_tree_of_depth_12_matches_per_path(P, N, kids, seed):
    """The deepest trees the engine allows (num_steps=12), with branches at many depths."""
    model = small_model()
    p = prompt(P + 1, seed)
    tree = spine_tree(int(p[-1]), N, 12, kids, seed)
    branching = sum(len(tree.children(u)) >= 2 for u in range(N))
    assert tree.max_depth == 12 and branching >= 3, f"{tree.max_depth=} {branching=}"
    check_against_oracle(model, engine_for(model), [p], [tree], f"depth 12 {P=} {N=} {kids=} {seed=}")


def test_one_node_tree_is_plain_decode():
    model = small_model()
    p = prompt(10, 3)
    tree = random_tree(int(p[-1]), 1, 0, 0, 0)
    check_against_oracle(model, engine_for(model), [p], [tree], "one node")


def test_equal_token_siblings():
    model = small_model()
    p = prompt(14, 4)
    root = int(p[-1])
    toks = torch.tensor([root, 77, 77, 77, 90, 90, 91])
    parents = torch.tensor([-1, 0, 0, 0, 1, 2, 3])
    import dsv4_tree as dt

    check_against_oracle(model, engine_for(model), [p], [dt.DraftTree(toks, parents)], "equal siblings")


def test_several_requests_different_P_and_shapes():
    model = small_model()
    eng = engine_for(model)
    spec = [(3, 10, 4, 3), (16, 25, 9, 2), (30, 6, 2, 5), (41, 18, 12, 1)]
    prompts = [prompt(P + 1, 50 + i) for i, (P, *_r) in enumerate(spec)]
    trees = [random_tree(int(p[-1]), n, d, k, 60 + i) for i, (p, (_, n, d, k)) in enumerate(zip(prompts, spec))]
    check_against_oracle(model, eng, prompts, trees, "mixed batch")


@pytest.mark.parametrize("topk", [1, 64])
def test_index_topk_below_and_above_candidate_count(topk):
    model = small_model(topk=topk)
    p = prompt(45, 11)  # 11 committed C4 entries, more in the tree
    tree = random_tree(int(p[-1]), 24, 8, 3, 12)
    check_against_oracle(model, engine_for(model), [p], [tree], f"index_topk={topk}")


def test_sliding_only_model():
    """The draft layer's shape: compress ratio 0 everywhere."""
    model = small_model(sliding_only=True)
    p = prompt(20, 13)
    tree = random_tree(int(p[-1]), 20, 7, 3, 14)
    check_against_oracle(model, engine_for(model), [p], [tree], "sliding only")


def test_tree_rows_equal_chain_verify_of_their_path():
    """Each node's logits equal our own chain verify of its root-to-node path."""
    model = small_model()
    eng = engine_for(model)
    p = prompt(19, 15)
    tree = random_tree(int(p[-1]), 20, 6, 3, 16)
    out = eng.verify([eng.prefill(p)], [tree]).logits[0]
    import dsv4_tree as dt

    for leaf in tree.leaves.tolist():
        chain = dt.DraftTree.chain(tree.path_tokens(leaf))
        c = eng.verify([eng.prefill(p)], [chain]).logits[0]
        nodes = tree.path[leaf][tree.path[leaf] >= 0]
        assert torch.allclose(out[nodes], c, rtol=1e-5, atol=1e-5), f"leaf={leaf}"
