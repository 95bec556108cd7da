"""Incremental, batched EAGLE-2 drafting produces the trees of the full-recompute reference
(dsv4_tree/reference/mtp_draft.py) on the shipped trained checkpoint."""
import functools

import pytest
import torch

import dsv4_tree as dt
from dsv4_tree.drafters import MtpDrafter, TreeShape
from dsv4_tree.reference.mtp_draft import full_recompute_draft
from dsv4_tree.train.corpus import heldout_prompt

# Scores are products of up to num_steps fp32 probabilities; the incremental rows sum their
# attention in another order than the dense HF layer, so they differ by rounding. A
# probability's relative error is about its logit's absolute error (~1e-6 at fp32 for logits
# of magnitude ~10), compounded over the steps: seen up to 1.2e-5 at 5 steps.
SCORE_TOL = 2e-5
# Across commits the reference starts from a fresh prefill, whose target streams come from
# GEMMs of another row count than the verify rows the drafter extends from: its inputs differ
# by rounding too (~1e-7 relative), which small probabilities amplify (seen: 1.1e-5).
COMMIT_SCORE_TOL = 3e-5


@functools.lru_cache(maxsize=None)
def trained():
    return dt.load_model(dt.trained_checkpoint())


def near_tie(ref, tol: float = SCORE_TOL) -> bool:
    """Two candidates of the reference pool whose scores differ by less than tol relative."""
    s = torch.sort(torch.cat([x.reshape(-1) for x in ref.score_list]), descending=True).values
    gaps = (s[:-1] - s[1:]) <= tol * s[:-1].abs()
    return bool(gaps.any())


def compare(ex, b: int, ref, label: str, tol: float = SCORE_TOL) -> bool:
    """True: same tree and scores within SCORE_TOL. False is allowed only where the reference
    has a near tie (either order is then correct)."""
    tree = ex.trees[b]
    same = torch.equal(tree.tokens, ref.tree.tokens) and torch.equal(tree.parents, ref.tree.parents)
    err = max(float(((a[b] - r[0]).abs() / r[0].abs().clamp_min(1e-30)).max())
              for a, r in zip(ex.score_list, ref.score_list))
    if same and err <= tol:
        assert all(torch.equal(a[b], r[0]) for a, r in zip(ex.token_list, ref.token_list)), label
        return True
    assert near_tie(ref, tol), f"{label}: trees equal={same}, score rel err {err:.2e}, and no near tie explains it"
    return False


@pytest.mark.parametrize("topk,steps,nodes", [(1, 3, 4), (4, 3, 8), (2, 4, 8), (4, 5, 16)])
def test_incremental_equals_full_recompute_after_prefill(topk, steps, nodes):
    model = trained()
    eng = dt.Engine(model, dt.SpecConfig(eagle_topk=topk, num_steps=steps, num_draft_tokens=nodes))
    drafter = MtpDrafter(model, TreeShape(topk, steps, nodes))
    # P < window, P = window, P > window; drafted together in one batch
    reqs = [eng.prefill(heldout_prompt(n, seed)) for seed, n in enumerate((20, 65, 150))]
    ex = drafter.expand(reqs)
    exact = [compare(ex, b, full_recompute_draft(model, drafter.mtp, r, topk, steps, nodes),
                     f"{topk=} {steps=} {nodes=} P={r.seq_len}") for b, r in enumerate(reqs)]
    assert sum(exact) >= len(exact) - 1, f"{topk=} {steps=} {nodes=}: too many near ties {exact}"


def test_incremental_equals_full_recompute_across_commits():
    """Rounds of draft -> verify -> accept -> commit for two requests at once; before every
    draft, the reference recomputes from a fresh prefill of the committed sequence."""
    model = trained()
    topk, steps, nodes = 4, 3, 8
    eng = dt.Engine(model, dt.SpecConfig(eagle_topk=topk, num_steps=steps, num_draft_tokens=nodes))
    drafter = MtpDrafter(model, TreeShape(topk, steps, nodes))
    reqs = [eng.prefill(heldout_prompt(n, 10 + n)) for n in (40, 90)]
    exact = total = 0
    for rnd in range(6):
        ex = drafter.expand(reqs)
        for b, req in enumerate(reqs):
            fresh = eng.prefill(torch.cat([req.tokens, torch.tensor([req.root_token])]))
            ref = full_recompute_draft(model, drafter.mtp, fresh, topk, steps, nodes)
            exact += compare(ex, b, ref, f"round {rnd} request {b} P={req.seq_len}", COMMIT_SCORE_TOL)
            total += 1
            eng.release(fresh)
        out = eng.verify(reqs, ex.trees)
        eng.commit(reqs, eng.accept_greedy(reqs, ex.trees, out), out)
    assert exact >= total - 1, f"{exact} of {total} drafts compared exactly"


@pytest.mark.parametrize("topk,steps,nodes", [(4, 3, 8), (2, 4, 8), (4, 5, 16)])
def test_drafter_trees_are_build_trees_tensors(topk, steps, nodes):
    """The drafter builds its DraftTrees from the selection directly; they are the trees that
    SGLang's build_tree tensors describe for the same expansion."""
    from dsv4_tree.tree.build import build_tree, organize_draft_results
    from dsv4_tree.tree.convert import tensors_to_trees

    model = trained()
    eng = dt.Engine(model, dt.SpecConfig(eagle_topk=topk, num_steps=steps, num_draft_tokens=nodes))
    drafter = MtpDrafter(model, TreeShape(topk, steps, nodes))
    reqs = [eng.prefill(heldout_prompt(n, seed)) for seed, n in enumerate((30, 70))]
    ex = drafter.expand(reqs)
    org = organize_draft_results(ex.score_list, ex.token_list, ex.parents_list, nodes)
    roots = torch.tensor([r.root_token for r in reqs])
    built = build_tree(roots, org.parent_list, org.top_scores_index, org.draft_tokens,
                       torch.tensor([r.seq_len for r in reqs]), topk, steps, nodes)
    want = tensors_to_trees(built.draft_tokens, built.retrieve_next_token, built.retrieve_next_sibling)
    for got, ref in zip(ex.trees, want):
        assert torch.equal(got.tokens, ref.tokens) and torch.equal(got.parents, ref.parents)
    assert any(t.max_depth > 1 for t in ex.trees)  # real trees, not only chains of the root
