"""generate_batch as a queue: more prompts than request rows, and pools that run out of pages
mid-run (preempt the newest request and recompute it later; a request that cannot fit alone
finishes with what it has). Greedy results equal per-prompt generate throughout."""
import torch

import dsv4_tree as dt
from cases import prompt
from dsv4_tree.drafters import PlantedDrafter, TreeShape
from test_mtp import mtp_model

SHAPE = TreeShape(4, 3, 8)


def _spec(**kw):
    return dt.SpecConfig(eagle_topk=4, num_steps=3, num_draft_tokens=8, page_size=16, **kw)


def _per_prompt(model, prompts, budgets, drafter):
    eng = dt.Engine(model, _spec())
    return [eng.generate(p, n, drafter=drafter, progress=False).tokens for p, n in zip(prompts, budgets)]


def test_more_prompts_than_request_rows_are_queued():
    model = mtp_model()
    prompts = [prompt(5 + 3 * i, i) for i in range(7)]
    budgets = [12, 20, 5, 16, 9, 14, 7]
    eng = dt.Engine(model, _spec(max_requests=2))
    got = eng.generate_batch(prompts, budgets, drafter="mtp", progress=False)
    assert [g.tokens for g in got] == _per_prompt(model, prompts, budgets, "mtp")
    assert all(g.stop_reason == "length" and g.stats.preemptions == 0 for g in got)
    assert eng.runtime.pages.free_rows == 2 and eng.runtime.live_slots() == {"token": 0, "recent": 0}
    assert not eng.named_drafters["mtp"].caches


def test_running_out_of_pages_preempts_and_keeps_every_token():
    model = mtp_model()
    drafter = PlantedDrafter(model, SHAPE, corrupt=0.3, seed=1)
    prompts = [prompt(20, 1), prompt(24, 2), prompt(18, 3)]
    budgets = [30, 30, 30]
    # 3 rows, token pages ceil(80 / 16) + 3 = 8: three requests start in 6 pages but need 4 each
    # (P + 8 draft slots) near the end, so one is preempted mid-run
    eng = dt.Engine(model, _spec(max_requests=3, max_total_tokens=80))
    got = eng.generate_batch(prompts, budgets, drafter=drafter, progress=False)
    assert [g.tokens for g in got] == _per_prompt(model, prompts, budgets, drafter)
    assert sum(g.stats.preemptions for g in got) >= 1, [g.stats.preemptions for g in got]
    assert all(g.stop_reason == "length" for g in got)
    assert eng.runtime.live_slots() == {"token": 0, "recent": 0}


def test_a_request_too_long_for_the_pools_finishes_with_what_it_has():
    model = mtp_model()
    drafter = PlantedDrafter(model, SHAPE, corrupt=0.3, seed=2)
    # token pages: ceil(64 / 16) + 2 = 6, 96 slots; the long request needs more than that alone
    eng = dt.Engine(model, _spec(max_requests=2, max_total_tokens=64))
    prompts = [prompt(30, 4), prompt(6, 5), prompt(200, 6)]
    budgets = [80, 10, 5]
    got = eng.generate_batch(prompts, budgets, drafter=drafter, progress=False)
    want = _per_prompt(model, prompts[:2], [80, 10], drafter)
    assert got[0].stop_reason == "out_of_pages" and 0 < len(got[0].tokens) < 80
    assert got[0].tokens == want[0][: len(got[0].tokens)]
    assert got[1].tokens == want[1] and got[1].stop_reason == "length"
    assert got[2].tokens == [] and got[2].stop_reason == "out_of_pages"
    assert eng.runtime.live_slots() == {"token": 0, "recent": 0}


def test_batch_sampling_follows_the_target_distribution():
    """top_p small enough that only the target's most likely token survives: sampled tokens are
    then the greedy ones, through the whole sampling path (accept_sampling, batches, budgets);
    a fixed generator seed reproduces a run at a real temperature."""
    model = mtp_model()
    prompts, budgets = [prompt(10, 1), prompt(5, 2)], [6, 9]
    eng = dt.Engine(model, dt.SpecConfig(eagle_topk=2, num_steps=3, num_draft_tokens=6, accept="sampling"))
    gen = torch.Generator().manual_seed(0)
    got = eng.generate_batch(prompts, budgets, drafter="mtp", temperature=0.8, top_p=1e-6, generator=gen,
                             progress=False)
    greedy = dt.Engine(model, dt.SpecConfig(eagle_topk=2, num_steps=3, num_draft_tokens=6))
    assert [g.tokens for g in got] == [greedy.generate(p, n, progress=False).tokens for p, n in zip(prompts, budgets)]
    runs = [eng.generate_batch(prompts, budgets, drafter="mtp", temperature=1.5,
                               generator=torch.Generator().manual_seed(3), progress=False) for _ in range(2)]
    assert [g.tokens for g in runs[0]] == [g.tokens for g in runs[1]]
    assert [len(g.tokens) for g in runs[0]] == budgets
