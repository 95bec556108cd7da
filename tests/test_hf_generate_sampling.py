"""Sampling through custom_generate is lossless: the first two generated tokens follow the
model's own distribution (transformers' temperature and top-k applied), drafts accepted."""
import torch

import dsv4_tree as dt
import dsv4_tree.hf_generate.target as target
from dsv4_tree.drafters.base import default_tree_nodes
from dsv4_tree.train.corpus import heldout_prompt
from test_hf_generate import hf_model
from test_sampling import chi2_sf

TEMPERATURE, TOP_K = 2.0, 3
ROWS, CALLS = 128, 8


def model_probs(model, ids: list) -> tuple[list, torch.Tensor]:
    """The target at the end of ids: top-k tokens and their probabilities after temperature."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1].double() / TEMPERATURE
    top, order = logits.topk(TOP_K)
    return order.tolist(), torch.softmax(top, -1)


def test_first_two_tokens_follow_the_model_joint(monkeypatch):
    model = hf_model("trained")
    # a held-out prompt whose next byte is uncertain (top-3 at 0.35 / 0.34 / 0.31 at T = 1) and
    # whose second byte is too, after each of them
    prompt = heldout_prompt(28, 6)
    first, p1 = model_probs(model, prompt)
    cells, expected = [], []
    for a, pa in zip(first, p1.tolist()):
        second, p2 = model_probs(model, prompt + [a])
        cells += [(a, b) for b in second]
        expected += [pa * pb for pb in p2.tolist()]
    accepted = []

    def counting(tree, probs, generator=None):
        path, bonus = real(tree, probs, generator)
        accepted.append(len(path) - 1)
        return path, bonus

    real = target.sample_tree
    monkeypatch.setattr(target, "sample_tree", counting)
    torch.manual_seed(0)  # transformers' sampling draws from the global generator; so do we
    counts = dict.fromkeys(cells, 0)
    ids = torch.tensor([prompt] * ROWS)
    for _ in range(CALLS):
        out = model.generate(ids, do_sample=True, temperature=TEMPERATURE, top_k=TOP_K, max_new_tokens=2,
                             custom_generate=dt.custom_generate, dsv4_drafter="mtp")  # the MTP block's trees
        for pair in out[:, len(prompt):].tolist():
            assert tuple(pair) in counts, f"{pair} outside the top-{TOP_K} support"
            counts[tuple(pair)] += 1
    n = ROWS * CALLS
    exp = torch.tensor(expected) * n
    stat = float(((torch.tensor([counts[c] for c in cells]) - exp) ** 2 / exp).sum())
    p_value = chi2_sf(stat, len(cells) - 1)
    # fixed seed, alpha 1e-3; every expected count is >= 77. Power, measured with the same seed
    # and n = 1024: a sampler that accepts the first draft child in the support gives chi2 =
    # 7661 (p = 0), and sampling at T = 1 instead of 2 gives chi2 = 68 (p = 1e-11).
    assert p_value > 1e-3, f"{p_value=} {stat=} counts={counts} expected={[round(e, 1) for e in exp.tolist()]}"
    # the second token came from an accepted draft node in most rows: the tree path is tested
    assert sum(a >= 1 for a in accepted) > 0.5 * len(accepted), f"drafts accepted: {sum(accepted)}"


def test_a_seeded_sampled_run_drafts_fixed_trees_and_repeats():
    """An adaptive tree's shape follows measured times, and with it which draws speculation makes:
    a sampled custom_generate drafts fixed trees (MTP and DSpark trees), so torch.manual_seed fixes
    its tokens; greedy keeps the adaptive default (its tokens never depend on the tree)."""
    model = hf_model("trained")
    ids = torch.tensor([heldout_prompt(60, 5)])
    for keys in ({"dsv4_drafter": "mtp"}, {"dsv4_eagle_topk": 4}):
        runs = []
        for _ in range(2):
            torch.manual_seed(7)
            runs.append(model.generate(ids, max_new_tokens=24, do_sample=True, temperature=1.5,
                                       custom_generate=dt.custom_generate, **keys))
        assert torch.equal(runs[0], runs[1]), keys
        model.generate(ids, max_new_tokens=4, do_sample=False, custom_generate=dt.custom_generate, **keys)
    specs = [key[0] for key in model.__dict__["_dsv4_tree_engines"]]
    sampled = {(s.eagle_topk, s.num_steps, s.num_draft_tokens, s.depth_mode) for s in specs if s.draft_depth == "fixed"}
    assert sampled == {(4, 2, 8, "fixed"), (4, 5, default_tree_nodes(4, 5), "fixed")}, specs
    assert {(s.eagle_topk, s.depth_mode) for s in specs if s.draft_depth is None} == {(4, "adaptive")}
