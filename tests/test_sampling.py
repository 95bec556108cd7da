"""Stochastic acceptance is lossless: emitted tokens follow the target distribution."""
import math

import pytest
import torch

import dsv4_tree as dt
from dsv4_tree.verify.sampling import sample_path, target_probs

V = 6
TRIALS = 20000


def chi2_sf(x, dof):
    """Survival function of chi-square (regularised upper gamma), series form."""
    a, z = dof / 2, x / 2
    term = total = 1.0 / a
    k = 1
    while term > 1e-15 * total and k < 10000:
        term *= z / (a + k)
        total += term
        k += 1
    lower = math.exp(-z + a * math.log(z) - math.lgamma(a)) * total
    return max(0.0, 1.0 - lower)


def tree_and_probs():
    # root -> children tokens 2, 2 (equal siblings), 4; node 1 -> children 0, 5; node 3 -> 1
    tree = dt.DraftTree.from_lists([3, 2, 2, 4, 0, 5, 1], [-1, 0, 0, 0, 1, 1, 3])
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(tree.num_nodes, V, generator=g) * 1.5
    return tree, logits


def test_first_two_tokens_follow_target_joint():
    tree, logits = tree_and_probs()
    probs = target_probs(logits, temperature=0.8, top_p=1.0)
    # target joint of the first two emitted tokens: p_root(a) * p_{node after a}(b); a draft
    # node with token a gives the next distribution; otherwise any distribution is fine, so
    # we test the first token's marginal and, conditioned on tokens with a node, the second
    g = torch.Generator().manual_seed(1)
    counts = torch.zeros(V)
    second = {2: torch.zeros(V), 4: torch.zeros(V)}
    for _ in range(TRIALS):
        path, bonus = sample_path(tree, probs, g)
        emitted = [int(tree.tokens[i]) for i in path[1:]] + [bonus]
        counts[emitted[0]] += 1
        if emitted[0] in second and len(emitted) > 1:
            second[emitted[0]][emitted[1]] += 1
    stat = float(((counts - TRIALS * probs[0]) ** 2 / (TRIALS * probs[0])).sum())
    p_first = chi2_sf(stat, V - 1)
    node_of = {2: 1, 4: 3}
    ps = [p_first]
    for tok, c in second.items():
        exp = c.sum() * probs[node_of[tok]]
        ps.append(chi2_sf(float(((c - exp) ** 2 / exp).sum()), V - 1))
    # fixed seed; at alpha=1e-3 per test. Power: a sampler that ignored the removal of
    # rejected siblings (the classic bug) double-counts token 2 here: its marginal shifts by
    # ~p(2)^2 = 0.0x, which with 20000 trials gives chi2 >> 100 (power ~1).
    assert min(ps) > 1e-3, f"p-values {ps}"


def test_wrong_sampler_is_detected():
    """Power check: a sampler that forgets to remove counted siblings fails the same test."""
    tree, logits = tree_and_probs()
    probs = target_probs(logits, temperature=0.8)
    g = torch.Generator().manual_seed(2)
    counts = torch.zeros(V)
    for _ in range(TRIALS):
        r = float(torch.rand(1, generator=g, dtype=torch.float64))
        cum, tok = 0.0, None
        for c in tree.children(0):
            cum += float(probs[0][int(tree.tokens[c])])  # no removal: equal siblings counted twice
            if r < cum:
                tok = int(tree.tokens[c])
                break
        if tok is None:
            rest = probs[0].clone()
            for c in tree.children(0):
                rest[int(tree.tokens[c])] = 0
            tok = int(torch.multinomial(rest / rest.sum(), 1, generator=g))
        counts[tok] += 1
    stat = float(((counts - TRIALS * probs[0]) ** 2 / (TRIALS * probs[0])).sum())
    assert chi2_sf(stat, V - 1) < 1e-6


def test_top_p_and_temperature_validation():
    logits = torch.tensor([[2.0, 1.0, 0.0, -5.0]])
    p = target_probs(logits, 1.0, top_p=0.7)
    assert p[0, 3] == 0 and p[0, 2] == 0 and abs(float(p.sum()) - 1) < 1e-12
    with pytest.raises(dt.InputError, match="temperature"):
        target_probs(logits, 0.0)
    with pytest.raises(dt.InputError, match="top_p"):
        target_probs(logits, 1.0, top_p=0.0)


def test_engine_accept_sampling_commits_the_sampled_path():
    """accept_sampling draws from the verified logits at the given temperature (same draws as
    sample_path on them), returns a root-to-node path, and commit leaves the state of serial
    decoding of the emitted tokens."""
    from cases import engine_for, prompt, small_model, snapshot
    from dsv4_tree.drafters import PlantedDrafter, TreeShape

    model = small_model()
    eng = engine_for(model)
    p = prompt(10, 1)
    req = eng.prefill(p)
    tree = PlantedDrafter(model, TreeShape(3, 4, 12), corrupt=0.0, seed=2).draft_one(req)
    out = eng.verify([req], [tree])
    acc = eng.accept_sampling([req], [tree], out, temperature=0.7, generator=torch.Generator().manual_seed(0))[0]
    path, bonus = sample_path(tree, target_probs(out.logits[0], 0.7), torch.Generator().manual_seed(0))
    assert (list(acc.path), acc.bonus) == (path, bonus)
    assert torch.equal(tree.path[path[-1], : len(path)], torch.tensor(path))
    emitted = acc.emitted(tree)
    eng.commit([req], [acc], out)
    fresh = eng.prefill(torch.cat([p, torch.tensor(emitted)]))
    assert torch.equal(req.tokens, fresh.tokens) and req.root_token == fresh.root_token
    for la, lb in zip(snapshot(eng, req), snapshot(eng, fresh)):
        for k in la:
            assert la[k].shape == lb[k].shape and (la[k].numel() == 0 or (la[k] - lb[k]).abs().max() < 1e-5), k
