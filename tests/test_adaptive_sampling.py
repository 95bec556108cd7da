"""Sampling stays lossless with adaptive draft depth: on the trees the adaptive MTP drafter
builds (cut after step 1 with 5 nodes, priced in between, the cold start), emitted
tokens follow the target distribution (chi-square, as tests/test_sampling.py).

The chi-square runs recursive rejection sampling (`sample_path`) many times on each tree the
policy chose: losslessness holds per fixed tree, and the policy fixes the tree before the
round's draws (design_notes/adaptive-depth.md), so per-tree is what has to be shown."""
import torch

import dsv4_tree as dt
from dsv4_tree.drafters import MtpDrafter, TreeShape
from dsv4_tree.train.corpus import heldout_prompt
from dsv4_tree.verify.sampling import sample_path, target_probs
from test_adaptive_depth import Clock, priced
from test_sampling import chi2_sf

PRESET = TreeShape(4, 5, 8)
TRIALS = 4000
TEMPERATURE = 1.0


def chi2_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square p-value of counts against probs; tokens expected < 5 times are pooled."""
    expected = counts.sum() * probs
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    return chi2_sf(stat, int(keep.sum()) - 1)


def trees_by_depth(monkeypatch):
    """(engine, request, {case: tree}) from adaptive drafters priced to stop at different depths."""
    model = dt.load_model(dt.trained_checkpoint())
    eng = dt.Engine(model, dt.SpecConfig(eagle_topk=4, num_steps=5, num_draft_tokens=8, accept="sampling"))
    clock = Clock()
    cost = {"step": 0.0}
    priced(monkeypatch, eng, clock, step=lambda rows: cost["step"], verify=lambda b: 0.05)
    out = {}
    for case, step_cost in (("cold", None), ("cut after step 1", 1.0), ("middle", 0.002)):
        drafter = MtpDrafter(model, PRESET, depth="adaptive", clock=clock)
        if step_cost is not None:  # learn this pricing over a few sampled rounds first
            cost["step"] = step_cost
            eng.generate(heldout_prompt(120, 7), 12, drafter=drafter, progress=False,
                         generator=torch.Generator().manual_seed(0))
        req = eng.prefill(torch.tensor(heldout_prompt(120, 3)))
        out[case] = (drafter.draft(eng, [req])[0], drafter.last_round, req)
    return eng, out


def test_sampled_tokens_follow_the_target_on_adaptive_trees(monkeypatch):
    eng, cases = trees_by_depth(monkeypatch)
    steps = {case: last.steps for case, (_, last, _) in cases.items()}
    assert steps["cut after step 1"] == 1 and steps["cold"] > 1 and 1 < steps["middle"] < 5, steps
    assert cases["cut after step 1"][0].num_nodes == 5  # only the root's 4 children were drafted
    ps = {}
    for case, (tree, _, req) in cases.items():
        out = eng.verify([req], [tree])
        probs = target_probs(out.logits[0], TEMPERATURE)
        g = torch.Generator().manual_seed(11)
        first = torch.zeros(probs.shape[1])
        child = max(tree.children(0), key=lambda c: float(probs[0, int(tree.tokens[c])]))  # likeliest drafted child
        second = torch.zeros(probs.shape[1])
        for _ in range(TRIALS):
            path, bonus = sample_path(tree, probs, g)
            emitted = [int(tree.tokens[i]) for i in path[1:]] + [bonus]
            first[emitted[0]] += 1
            if emitted[0] == int(tree.tokens[child]):
                second[emitted[1]] += 1  # after that token, the target's distribution at `child`
        ps[case] = (chi2_p(first, probs[0]), chi2_p(second, probs[child]))
        eng.release(req)
    # fixed seeds; alpha 1e-3 per test. A sampler that kept rejected siblings' mass (the bug
    # tests/test_sampling.py guards) shifts these marginals by far more than 4000 trials resolve
    assert min(p for pair in ps.values() for p in pair) > 1e-3, ps


def test_sampled_generate_with_adaptive_depth_reports_steps():
    n = 10
    model = dt.load_model(dt.trained_checkpoint())
    eng = dt.Engine(model, dt.SpecConfig(eagle_topk=4, num_steps=5, num_draft_tokens=8, accept="sampling"))
    res = eng.generate(heldout_prompt(100, 2), n, drafter="mtp", progress=False,
                       generator=torch.Generator().manual_seed(1))
    assert len(res.tokens) == n and len(res.stats.draft_steps) == res.stats.rounds
    assert all(1 <= s <= 5 for s in res.stats.draft_steps) and res.stats.depth.rounds_observed == res.stats.rounds
