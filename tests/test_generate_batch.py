"""generate_batch: one verify per round for all live requests, each finishing on its own,
token for token equal to per-prompt generate (greedy)."""
import torch

import dsv4_tree as dt
from cases import prompt
from dsv4_tree.drafters import PlantedDrafter, TreeShape
from test_mtp import mtp_model

NEW = 24


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
    assert [g.tokens for g in got] == [w.tokens for w in want]
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
    for p, n, g in zip(prompts, budgets, got):
        assert g.tokens == eng.generate(p, n, drafter=drafter, progress=False).tokens
        assert len(g.tokens) == n
    assert got[0].stats.accept_lengths == [5] and got[1].stats.accept_lengths == [7, 3]  # cut mid-path
    assert got[2].stats.accept_lengths == [7]


def test_generate_batch_sampling_runs_and_respects_budgets():
    model = mtp_model()
    eng = dt.Engine(model, dt.SpecConfig(eagle_topk=2, num_steps=3, num_draft_tokens=6, accept="sampling"))
    gen = torch.Generator().manual_seed(0)
    got = eng.generate_batch([prompt(10, 1), prompt(5, 2)], [6, 9], drafter="mtp", temperature=0.8,
                             generator=gen, progress=False)
    assert [len(g.tokens) for g in got] == [6, 9]
    assert all(0 <= t < model.vocab_size for g in got for t in g.tokens)
