"""generate_batch: one verify per round for all live requests, each finishing on its own,
token for token equal to per-prompt generate (greedy) up to a near tie."""
import pytest
import torch

import dsv4_tree as dt
from cases import REL_TOL, prompt
from dsv4_tree.drafters import PlantedDrafter, TreeShape
from dsv4_tree.reference import per_path_logits
from test_mtp import mtp_model

NEW = 24


def assert_same_greedy(model, ids, got: list, want: list, label: str = "", prefix: bool = False) -> None:
    """Greedy tokens of a batched run (`got`) equal those of the prompt run alone (`want`), or
    the two part at a near tie, the only place the batch's other summation order may decide
    (design_notes/generation.md, "Batch invariance"): each run's logits lie within
    d = REL_TOL * max|e| of the per-path oracle's e, so where they pick different tokens both
    lie within 2d of e's best; or an indexer top-k boundary on the path was a near tie (the
    rows' topk_ties, counted on the path run alone). prefix: `got` may stop early (out of pages)."""
    k = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if k is None:
        assert len(got) == len(want) or (prefix and len(got) < len(want)), f"{label}: {len(got)=} {len(want)=}"
        return
    ctx = torch.cat([torch.as_tensor(ids), torch.tensor(got[:k], dtype=torch.int64)])
    e = per_path_logits(model, ctx[:-1], dt.DraftTree.chain(ctx[-1:]))[0].double()
    d = REL_TOL * float(e.abs().max())
    behind = [float(e.max() - e[t]) for t in (got[k], want[k])]
    if max(behind) <= 2 * d:
        return
    eng = dt.Engine(model)
    req = eng.prefill(ctx)
    ties = req.committed_topk_ties + eng.verify([req], [dt.DraftTree.chain(ctx[-1:])]).topk_ties
    assert ties > 0, (f"{label}: the runs part at token {k} ({got[k]} vs {want[k]}), {behind=} behind the oracle's "
                      f"best, more than 2d = {2 * d:.3e}, and no indexer near tie on the path")


def test_generate_batch_equals_per_prompt_generate_with_eos_and_budgets():
    model = mtp_model()
    eng = dt.Engine(model, dt.SpecConfig(eagle_topk=4, num_steps=4, num_draft_tokens=12))
    prompts = [prompt(12, 5).repeat(2), prompt(7, 6), prompt(31, 7), prompt(3, 8)]  # different lengths
    plain = [eng.generate(p, NEW, drafter="mtp", progress=False).tokens for p in prompts]
    # an EOS that ends some requests early and never occurs in others
    eos = next(t for t in plain[0][2:] if any(t not in other for other in plain[1:]))
    budgets = [NEW, NEW - 5, NEW, 11]
    want = [eng.generate(p, n, drafter="mtp", eos_token_id=eos, progress=False) for p, n in zip(prompts, budgets)]
    got = eng.generate_batch(prompts, budgets, drafter="mtp", eos_token_id=eos, progress=False)
    for i, (p, g, w) in enumerate(zip(prompts, got, want)):
        assert_same_greedy(model, p, g.tokens, w.tokens, f"prompt {i}")
    stopped = [len(g.tokens) < n for g, n in zip(got, budgets)]
    assert any(stopped) and not all(stopped), f"{eos=} {stopped=}: EOS must end some requests but not all"
    for g, n, s in zip(got, budgets, stopped):
        assert (g.tokens[-1] == eos) if s else (len(g.tokens) == n)
        assert sum(g.stats.accept_lengths) == len(g.tokens) and g.stats.rounds == len(g.stats.accept_lengths)
    assert not eng.named_drafters["mtp"].caches, "finished requests must release their drafter state"


def test_generate_batch_budgets_cut_inside_accepted_paths():
    model = mtp_model()
    eng = dt.Engine(model, dt.SpecConfig(eagle_topk=1, num_steps=6, num_draft_tokens=7))
    drafter = PlantedDrafter(model, TreeShape(1, 6, 7), corrupt=0.0, seed=0)  # every draft accepted: 7 per round
    prompts = [prompt(9, 1), prompt(20, 2), prompt(14, 3)]
    budgets = [5, 10, 7]
    got = eng.generate_batch(prompts, budgets, drafter=drafter, progress=False)
    for i, (p, n, g) in enumerate(zip(prompts, budgets, got)):
        assert_same_greedy(model, p, g.tokens, eng.generate(p, n, drafter=drafter, progress=False).tokens, f"prompt {i}")
        assert len(g.tokens) == n
    assert got[0].stats.accept_lengths == [5] and got[1].stats.accept_lengths == [7, 3]  # cut mid-path
    assert got[2].stats.accept_lengths == [7]


def test_generate_batch_sampling_runs_and_respects_budgets():
    """Sampled, not greedy: the run differs from the greedy tokens, which a sampler would hit
    with probability prod_k p(greedy token k) (the oracle's, along the greedy path: < 1e-6 here,
    so the seed is not what makes them differ); with fixed depth a seed repeats the run."""
    model = mtp_model()
    prompts, budgets, temperature = [prompt(10, 1), prompt(5, 2)], [6, 9], 0.8
    spec = dict(eagle_topk=2, num_steps=3, num_draft_tokens=6, draft_depth="fixed")
    eng = dt.Engine(model, dt.SpecConfig(accept="sampling", **spec))
    runs = [eng.generate_batch(prompts, budgets, drafter="mtp", temperature=temperature,
                               generator=torch.Generator().manual_seed(0), progress=False) for _ in range(2)]
    got = [g.tokens for g in runs[0]]
    assert [len(t) for t in got] == budgets and got == [g.tokens for g in runs[1]]
    assert all(0 <= t < model.vocab_size for t in sum(got, []))
    greedy = dt.Engine(model, dt.SpecConfig(**spec))
    want = [greedy.generate(p, n, drafter="mtp", progress=False).tokens for p, n in zip(prompts, budgets)]
    chance = 1.0
    for p, w in zip(prompts, want):
        path = torch.cat([p[-1:], torch.tensor(w[:-1])])
        probs = torch.softmax(per_path_logits(model, p[:-1], dt.DraftTree.chain(path)).double() / temperature, -1)
        chance *= float(probs[torch.arange(len(w)), torch.tensor(w)].prod())
    assert chance < 1e-6, f"{chance=}: a sampler would give the greedy tokens too often for this check"
    assert got != want, "sampled tokens equal the greedy ones"


def test_a_parting_away_from_a_near_tie_is_caught():
    """assert_same_greedy accepts only what is guaranteed: a token the target ranks far below its
    best, where no indexer near tie lies on the path, is a real difference."""
    model = mtp_model()
    p = prompt(10, 3)
    want = dt.Engine(model).generate(p, 6, progress=False).tokens
    e = per_path_logits(model, torch.cat([p, torch.tensor(want[:2])])[:-1], dt.DraftTree.chain(torch.tensor(want[1:2])))[0]
    wrong = want[:2] + [int(e.argmin())] + want[3:]
    with pytest.raises(AssertionError, match="part at token 2"):
        assert_same_greedy(model, p, wrong, want, "corrupted")
