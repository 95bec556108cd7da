"""SGLang-compatible tree tensors: property tests over random drafts and trees."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dsv4_tree as dt
from dsv4_tree.tree.simulate import eagle_tree, simulated_eagle_draft
from dsv4_tree.tree import (
    TreeMaskMode, build_tree, organize_draft_results, tensors_to_trees, trees_to_tensors, unpack_bits,
    verify_tree_greedy,
)

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True)


def eagle_draft(bs, k, steps, seed):
    """Simulated EAGLE expansion: cumulative scores are products of probabilities <= 1."""
    return simulated_eagle_draft(bs, k, steps, seed, vocab=50)


@st.composite
def draft_case(draw):
    k = draw(st.integers(1, 4))
    steps = draw(st.integers(1, 5))
    pool = k + (steps - 1) * k * k
    n = draw(st.integers(1, min(pool + 1, 32)))
    return draw(st.integers(1, 3)), k, steps, n, draw(st.integers(0, 10**6))


@SETTINGS
@given(draft_case())
def test_selection_is_connected_and_masks_agree(case):
    bs, k, steps, n, seed = case
    scores, tokens, parents = eagle_draft(bs, k, steps, seed)
    org = organize_draft_results(scores, tokens, parents, n)
    seq_lens = torch.randint(0, 100, (bs,), generator=torch.Generator().manual_seed(seed))
    bonus = torch.arange(bs) + 7
    built = build_tree(bonus, org.parent_list, org.top_scores_index, org.draft_tokens, seq_lens, k, steps, n,
                       TreeMaskMode.QLEN_ONLY)
    trees = tensors_to_trees(built.draft_tokens, built.retrieve_next_token, built.retrieve_next_sibling)
    for b, tree in enumerate(trees):  # connected, parents first (DraftTree validates that)
        assert tree.num_nodes == n and int(tree.tokens[0]) == int(bonus[b])
        assert torch.equal(tree.parents, built.parents[b])
        assert torch.equal(built.positions.view(bs, n)[b], tree.positions(int(seq_lens[b])))
        assert tree.max_depth <= steps
    anc = torch.stack([t.ancestors for t in trees])
    assert torch.equal(built.tree_mask.view(bs, n, n), anc)
    for mode in TreeMaskMode:
        if mode == TreeMaskMode.QLEN_ONLY_BITPACKING:
            again = build_tree(bonus, org.parent_list, org.top_scores_index, org.draft_tokens, seq_lens, k, steps,
                               n, mode)
            rows = unpack_bits(again.tree_mask, n).view(bs, n, n)
            assert torch.equal(rows, anc)
            assert torch.equal(rows.sum(-1), torch.stack([t.depth for t in trees]) + 1)  # popcount
        elif mode == TreeMaskMode.FULL_MASK:
            full = build_tree(bonus, org.parent_list, org.top_scores_index, org.draft_tokens, seq_lens, k, steps, n,
                              mode).tree_mask
            off = 0
            for b in range(bs):
                L = int(seq_lens[b])
                blk = full[off : off + n * (L + n)].view(n, L + n)
                assert blk[:, :L].all() and torch.equal(blk[:, L:], anc[b])
                off += n * (L + n)
            assert off == full.numel()


@st.composite
def random_trees(draw):
    n = draw(st.integers(1, 40))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    tokens = [draw(st.integers(0, 5)) for _ in range(n)]
    return dt.DraftTree.from_lists(tokens, parents)


def brute_force_accept(tree, target, steps):
    path, u = [0], 0
    for _ in range(steps - 1):
        nxt = next((c for c in tree.children(u) if int(tree.tokens[c]) == int(target[u])), None)
        if nxt is None:
            break
        path.append(nxt)
        u = nxt
    return path


@SETTINGS
@given(random_trees(), st.integers(0, 10**6))
def test_greedy_equals_brute_force(tree, seed):
    n = tree.num_nodes
    target = torch.randint(0, 6, (n,), generator=torch.Generator().manual_seed(seed))
    t = trees_to_tensors([tree], [10])
    steps = tree.max_depth + 1
    res = verify_tree_greedy(tree.tokens.unsqueeze(0), t["retrieve_index"], t["retrieve_next_token"],
                             t["retrieve_next_sibling"], target, steps)
    want = brute_force_accept(tree, target, steps)
    got = res.accept_index[0][res.accept_index[0] >= 0].tolist()
    assert got == want
    assert int(res.accept_token_num[0]) == len(want) - 1
    for a, b in zip(want, want[1:]):
        assert int(res.predicts[a]) == int(tree.tokens[b])
    assert int(res.predicts[want[-1]]) == int(target[want[-1]])


@SETTINGS
@given(random_trees())
def test_tree_invariants(tree):
    n = tree.num_nodes
    assert torch.equal(tree.positions(5), tree.depth + 5)
    assert torch.equal(tree.ancestors.sum(-1), tree.depth + 1)
    for i in range(n):
        p = tree.path[i][tree.path[i] >= 0]
        assert int(p[0]) == 0 and int(p[-1]) == i and p.numel() == int(tree.depth[i]) + 1
    again = tensors_to_trees(tree.tokens, *[trees_to_tensors([tree], [0])[k] for k in ("retrieve_next_token", "retrieve_next_sibling")])[0]
    assert torch.equal(again.parents, tree.parents)


def test_chain_mask_is_lower_triangular():
    tree = dt.DraftTree.chain([4, 5, 6, 7, 8])
    assert torch.equal(tree.ancestors, torch.tril(torch.ones(5, 5, dtype=torch.bool)))
    assert tree.positions(10).tolist() == [10, 11, 12, 13, 14]


def test_missing_parent_raises():
    scores, tokens, parents = eagle_draft(1, 2, 3, 0)
    org = organize_draft_results(scores, tokens, parents, 6)
    # drop a parent from the selection, as NaN scores would
    idx = org.top_scores_index.clone()
    child = int((idx // 2 > 0).nonzero()[0, 1]) if (idx // 2 > 0).any() else None
    assert child is not None
    par_cand = int(org.parent_list[0, int(idx[0, child]) // 2])
    idx[idx == par_cand] = 1000 + par_cand  # now unreachable
    idx = idx.sort(-1).values
    with pytest.raises(dt.TreeError, match="parent"):
        build_tree(torch.tensor([1]), org.parent_list, idx.clamp(max=org.parent_list.shape[1] * 2 - 1),
                   org.draft_tokens, torch.tensor([3]), 2, 3, 6)


def test_nan_scores_give_clear_error_or_valid_tree():
    scores, tokens, parents = eagle_draft(1, 2, 3, 1)
    scores[1][:] = float("nan")
    org = organize_draft_results(scores, tokens, parents, 6)
    try:
        built = build_tree(torch.tensor([1]), org.parent_list, org.top_scores_index, org.draft_tokens,
                           torch.tensor([3]), 2, 3, 6)
    except dt.TreeError as exc:
        assert "parent" in str(exc)
    else:
        tensors_to_trees(built.draft_tokens, built.retrieve_next_token, built.retrieve_next_sibling)


def test_bad_sizes_and_types():
    scores, tokens, parents = eagle_draft(1, 2, 2, 0)
    with pytest.raises(dt.TreeError, match="candidate pool = 6"):
        organize_draft_results(scores, tokens, parents, 8)
    org = organize_draft_results(scores, tokens, parents, 5)
    big = eagle_draft(1, 6, 2, 0)
    big_org = organize_draft_results(*big, 34)
    with pytest.raises(dt.TreeError, match="at most 32"):
        build_tree(torch.tensor([1]), big_org.parent_list, big_org.top_scores_index, big_org.draft_tokens,
                   torch.tensor([0]), 6, 2, 34, TreeMaskMode.QLEN_ONLY_BITPACKING)
    with pytest.raises(dt.TreeError, match="int32 or int64"):
        build_tree(torch.tensor([1.0]), org.parent_list, org.top_scores_index, org.draft_tokens, torch.tensor([0]),
                   2, 2, 5)
    with pytest.raises(dt.TreeError, match="num_draft_tokens-1=5"):
        build_tree(torch.tensor([1]), org.parent_list, org.top_scores_index, org.draft_tokens, torch.tensor([0]),
                   2, 2, 6)


def test_malformed_links_raise():
    from dsv4_tree.tree import parents_from_links

    with pytest.raises(dt.TreeError, match="outside"):
        parents_from_links(torch.tensor([[5, -1]]), torch.tensor([[-1, -1]]))
    with pytest.raises(dt.TreeError, match="twice"):
        parents_from_links(torch.tensor([[1, -1, -1]]), torch.tensor([[-1, 1, -1]]))
    with pytest.raises(dt.TreeError, match="reachable"):
        parents_from_links(torch.tensor([[1, -1, -1]]), torch.tensor([[-1, -1, -1]]))


@pytest.mark.parametrize("n,topk", [(1, 4), (2, 4), (8, 4), (16, 4), (64, 4), (10, 2)])
def test_eagle_tree_has_n_nodes_and_eagle_branching(n, topk):
    tree = eagle_tree(7, n, topk=topk, seed=n, vocab=50)
    kids = torch.bincount(tree.parents[1:], minlength=n) if n > 1 else torch.zeros(1, dtype=torch.int64)
    assert tree.num_nodes == n and int(tree.tokens[0]) == 7, f"{n=} {topk=}"
    assert int(tree.tokens.max()) < 50 and int(kids.max()) <= topk, f"{n=} {topk=} children={kids.tolist()}"
