"""generate_batch as a queue: more prompts than request rows, and pools that run out of pages
mid-run (preempt the newest request and recompute it later; a request alone has its tree cut
to the slots left, and one whose context cannot fit finishes with what it has). Greedy results
equal per-prompt generate throughout (up to a near tie: test_generate_batch.assert_same_greedy);
sampled first tokens follow the target distribution."""
import pytest
import torch

import dsv4_tree as dt
from cases import prompt
from dsv4_tree.drafters import PlantedDrafter, TreeShape
from dsv4_tree.reference import per_path_logits
from dsv4_tree.train.corpus import heldout_prompt
from test_adaptive_sampling import chi2_p
from test_generate_batch import assert_same_greedy
from test_mtp import mtp_model

SHAPE = TreeShape(4, 3, 8)


def _spec(**kw):
    return dt.SpecConfig(eagle_topk=4, num_steps=3, num_draft_tokens=8, page_size=16, **kw)


def _per_prompt(model, prompts, budgets, drafter):
    eng = dt.Engine(model, _spec())
    return [eng.generate(p, n, drafter=drafter, progress=False).tokens for p, n in zip(prompts, budgets)]


def _same(model, prompts, got, want, prefix=()):
    for i, (p, g, w) in enumerate(zip(prompts, got, want)):
        assert_same_greedy(model, p, g.tokens, w, f"prompt {i}", prefix=i in prefix)


def _counting_prefills(eng) -> dict:
    """Count the rows every prefill_batch call computes and those of the calls that succeed."""
    rows, real = {"computed": 0, "kept": 0}, eng.prefill_batch

    def counting(prompts, *args, **kw):
        n = sum(len(p) - 1 for p in prompts)
        rows["computed"] += n
        reqs = real(prompts, *args, **kw)
        rows["kept"] += n
        return reqs

    eng.prefill_batch = counting
    return rows


def test_more_prompts_than_request_rows_are_queued():
    model = mtp_model()
    prompts = [prompt(5 + 3 * i, i) for i in range(7)]
    budgets = [12, 20, 5, 16, 9, 14, 7]
    eng = dt.Engine(model, _spec(max_requests=2))
    got = eng.generate_batch(prompts, budgets, drafter="mtp", progress=False)
    _same(model, prompts, got, _per_prompt(model, prompts, budgets, "mtp"))
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
    _same(model, prompts, got, _per_prompt(model, prompts, budgets, drafter))
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
    rows = _counting_prefills(eng)
    got = eng.generate_batch(prompts, budgets, drafter=drafter, progress=False)
    _same(model, prompts[:2], got, _per_prompt(model, prompts[:2], [80, 10], drafter), prefix={0})
    assert got[0].stop_reason == "out_of_pages" and 0 < len(got[0].tokens) < 80
    assert got[1].stop_reason == "length"
    assert got[2].tokens == [] and got[2].stop_reason == "out_of_pages"
    assert rows["computed"] == rows["kept"], f"{rows}: the 200-token prompt was prefilled though it cannot fit"
    assert eng.runtime.live_slots() == {"token": 0, "recent": 0}


def test_after_a_request_runs_out_of_pages_the_queue_resumes():
    """96 token slots, 2 rows: the 40-token prompt outgrows them, and while it grows the newest
    request is preempted; alone, it drafts only what the free slots hold (its last rounds cut
    to the slots left, so it ends with all 96 committed), and when it ends out of pages the
    preempted request is admitted again and finishes, as it does alone."""
    model = mtp_model()
    eng = dt.Engine(model, _spec(max_requests=2, max_total_tokens=64, draft_depth="fixed"))  # 64 / 16 + 2 = 6 pages
    prompts, budgets = [prompt(40, 4), prompt(10, 5), prompt(12, 6)], [80, 10, 20]
    got = eng.generate_batch(prompts, budgets, drafter="mtp", progress=False)
    _same(model, prompts, got, _per_prompt(model, prompts, budgets, "mtp"), prefix={0})
    assert got[0].stop_reason == "out_of_pages" and len(prompts[0]) - 1 + len(got[0].tokens) == 96, len(got[0].tokens)
    assert got[2].stats.preemptions >= 1, [g.stats.preemptions for g in got]
    assert [g.stop_reason for g in got[1:]] == ["length", "length"]
    assert eng.runtime.live_slots() == {"token": 0, "recent": 0}


def test_a_prompt_is_prefilled_only_when_its_pages_are_free():
    """Long prompts that fit the pools one or two at a time, not beside each other: each is
    prefilled once it fits (plus once per preemption), never computed and thrown away."""
    model = mtp_model()
    eng = dt.Engine(model, _spec(max_requests=3, max_total_tokens=128, draft_depth="fixed"))  # 128 / 16 + 3 = 11 pages
    prompts, budgets = [prompt(40 + 7 * i, 10 + i) for i in range(5)], [16] * 5
    rows = _counting_prefills(eng)
    got = eng.generate_batch(prompts, budgets, drafter="mtp", progress=False)
    _same(model, prompts, got, _per_prompt(model, prompts, budgets, "mtp"))
    assert all(g.stop_reason == "length" for g in got)
    assert rows["computed"] == rows["kept"], rows
    recomputed = sum(len(p) - 1 for p in prompts) + sum(
        g.stats.preemptions * (len(p) - 1 + len(g.tokens)) for p, g in zip(prompts, got))
    assert rows["kept"] <= recomputed, (rows, recomputed)


def test_no_free_request_row_is_a_state_error():
    model = mtp_model()
    eng = dt.Engine(model, _spec(max_requests=2))
    held = [eng.prefill(prompt(9, 1)), eng.prefill(prompt(7, 2))]  # the caller's own live requests
    before = [(r.seq_len, r.tokens.clone(), r.root_token) for r in held], eng.runtime.live_slots()
    with pytest.raises(dt.StateError, match=r"free request row.*SpecConfig\.max_requests"):
        eng.generate_batch([prompt(5, 3)], 4, drafter="mtp", progress=False)
    after = [(r.seq_len, r.tokens.clone(), r.root_token) for r in held], eng.runtime.live_slots()
    assert all(a[0] == b[0] and torch.equal(a[1], b[1]) and a[2] == b[2] for a, b in zip(before[0], after[0]))
    assert before[1] == after[1]
    eng.release(held[1])
    assert len(eng.generate_batch([prompt(5, 3)], 4, drafter="mtp", progress=False)[0].tokens) == 4


SAMPLES, ROWS, TEMPERATURE = 320, 16, 1.0


@pytest.mark.parametrize("topk,steps,nodes", [(4, 2, 8), (1, 2, 3)], ids=["tree", "chain"])
def test_batch_sampling_follows_the_target_distribution(topk, steps, nodes):
    """SAMPLES copies of one held-out prompt, ROWS at a time (the rest queued), 2 tokens each:
    the first tokens generate_batch samples, through accepted draft nodes or the bonus, follow
    the target's distribution (the per-path oracle's, at TEMPERATURE)."""
    model = dt.load_model(dt.trained_checkpoint())
    ids = torch.tensor(heldout_prompt(28, 4))  # a next byte with three likely values (0.47 / 0.28 / 0.19)
    logits = per_path_logits(model, ids[:-1], dt.DraftTree.chain(ids[-1:]))[0]
    probs = torch.softmax(logits.double() / TEMPERATURE, -1)
    spec = dt.SpecConfig(eagle_topk=topk, num_steps=steps, num_draft_tokens=nodes, draft_depth="fixed",
                         accept="sampling", max_requests=ROWS, page_size=16, max_total_tokens=ROWS * 48)
    got = dt.Engine(model, spec).generate_batch([ids] * SAMPLES, 2, drafter="mtp", temperature=TEMPERATURE,
                                                generator=torch.Generator().manual_seed(0), progress=False)
    first = torch.zeros(probs.numel(), dtype=torch.float64)
    for g in got:
        first[g.tokens[0]] += 1
    p = chi2_p(first, probs)
    drafted = sum(g.stats.accept_lengths[0] == 2 for g in got)  # the first token was an accepted draft node
    # fixed seed and depth: deterministic; alpha 1e-3. Power, measured with this seed: greedy
    # acceptance (every first token the argmax) gives p = 0 for both; a lossy sampler (each child
    # accepted with its own probability, the bonus from the whole target) p = 5e-9 (tree), 8e-16 (chain)
    assert p > 1e-3, f"{topk=} {p=} counts={first[first > 0].tolist()} expected={(SAMPLES * probs[first > 0]).tolist()}"
    assert drafted >= SAMPLES // 4, f"{topk=}: only {drafted} first tokens came from draft nodes"
