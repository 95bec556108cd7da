"""Adaptive draft depth (drafters/depth.py): the policy on constructed cases, with an injected
clock so no decision depends on this machine's timing, and outputs equal plain greedy."""
from types import SimpleNamespace

import pytest
import torch

import dsv4_tree as dt
import dsv4_tree.drafters.mtp as mtp_module
import dsv4_tree.drafters.mtp_wave as wave_module
from dsv4_tree.drafters import MtpDrafter, TreeShape
from dsv4_tree.drafters.depth import DepthPolicy, candidate_depths
from dsv4_tree.drafters.mtp_rows import MtpRows
from dsv4_tree.train.corpus import heldout_prompt


def hf_greedy(model, ids, n) -> list:
    """Plain greedy: Hugging Face generate with its own cache."""
    ids = torch.as_tensor(ids)
    with torch.no_grad():
        out = model.hf.generate(ids.unsqueeze(0), max_new_tokens=n, do_sample=False)
    return out[0, ids.numel():].tolist()


PRESET = TreeShape(4, 5, 8)  # configs/tree_topk4.toml
NEW = 32


class Clock:
    """Fake seconds: advanced only by the priced operations below."""

    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def priced(monkeypatch, engine, clock, step, verify):
    """Every draft step s >= 1 (a draft_rows pass over `rows` frontier rows) costs step(rows) fake
    seconds and every verify of b requests verify(b)."""
    real_rows, real_verify = wave_module.draft_rows, engine.verify

    def priced_rows(model, mtp, ids, *args, **kwargs):
        clock.t += step(ids.shape[0])
        return real_rows(model, mtp, ids, *args, **kwargs)

    def priced_verify(reqs, trees, *args, **kwargs):
        clock.t += verify(len(reqs))
        return real_verify(reqs, trees, *args, **kwargs)

    monkeypatch.setattr(wave_module, "draft_rows", priced_rows)
    monkeypatch.setattr(engine, "verify", priced_verify)


def stops_of(monkeypatch, drafter) -> list:
    """The stop reason of every draft the drafter makes, in order."""
    seen, real = [], drafter.expand

    def expand(requests, depth=None, graphed=False):
        out = real(requests, depth, graphed)
        seen.append(drafter.last_round.stop)
        return out

    monkeypatch.setattr(drafter, "expand", expand)
    return seen


@pytest.fixture(scope="module")
def trained():
    model = dt.load_model(dt.trained_checkpoint())
    ids = torch.tensor(heldout_prompt(160, 1))
    return model, ids, hf_greedy(model, ids, NEW)


def engine(model, shape=PRESET, **spec):
    return dt.Engine(model, dt.SpecConfig(eagle_topk=shape.topk, num_steps=shape.num_steps,
                                          num_draft_tokens=shape.num_draft_tokens, **spec))


# ---------------------------------------------------------------- the policy alone (host tensors)
def test_exact_stop_needs_every_frontier_score_strictly_below_the_kth_best():
    pol = DepthPolicy(topk=4, num_steps=3, num_draft_tokens=3)  # 2 draft nodes: kth = 2nd best
    pool = torch.tensor([[0.5, 0.3, 0.1, 0.05]])
    assert pol.exact_stop(pool, torch.tensor([[0.2, 0.1, 0.05, 0.01]]))
    assert not pol.exact_stop(pool, torch.tensor([[0.3, 0.1, 0.05, 0.01]]))  # a tie could still enter
    two = torch.cat([pool, pool])  # the whole batch must be done
    assert not pol.exact_stop(two, torch.tensor([[0.2, 0.1, 0.0, 0.0], [0.4, 0.1, 0.0, 0.0]]))
    small = DepthPolicy(topk=4, num_steps=3, num_draft_tokens=8)  # 7 slots, 4 candidates: room left
    assert not small.exact_stop(pool, torch.tensor([[1e-9] * 4]))


def test_gain_is_the_calibrated_score_mass_the_predicted_children_add():
    pol = DepthPolicy(topk=2, num_steps=3, num_draft_tokens=4)  # 3 slots
    pool = torch.tensor([[0.6, 0.3]])
    children = torch.tensor([[0.9, 0.05]])  # predicted 0.54, 0.03 under 0.6 and 0.27, 0.015 under 0.3
    assert pol.gain(pool, pool, children, depth=2) == pytest.approx(0.54)  # fills the empty slot
    full = torch.tensor([[0.6, 0.3, 0.5, 0.01, 0.2, 0.1]])  # after a step: best 3 = 0.6, 0.5, 0.3
    front = torch.tensor([[0.5, 0.2]])
    assert pol.gain(full, front, children, depth=3) == pytest.approx(0.45 - 0.3)
    pol.accepted_mass, pol.predicted_mass = [1.0, 0.0, 0.0], [3.0, 0.0, 0.0]  # depth 1: 1 of 3 accepted
    cal = pol.calibration()
    assert cal[0] == pytest.approx(0.5) and cal[1] == cal[2] == pytest.approx(0.5)  # prior: the depth above
    assert pol.gain(full, front, children, depth=3) == pytest.approx(0.5 * (0.45 - 0.3))


def test_more_runs_unmeasured_steps_and_weighs_measured_ones():
    clock = Clock()
    pol = DepthPolicy(topk=2, num_steps=3, num_draft_tokens=4, clock=clock)
    pool, children = torch.tensor([[0.6, 0.3]]), torch.tensor([[0.9, 0.05]])
    req = SimpleNamespace(request_id=1, seq_len=10)
    assert pol.more(1, pool, pool, children) is None  # nothing measured: run it
    pol.begin()
    pol.step_begin()
    clock.t += 1.0  # a draft step of one request costs 1 s
    pol.step_end(1)
    pol.drafted([req], torch.tensor([[0.6, 0.54, 0.3]]), torch.tensor([[1, 2, 1]]))
    clock.t += 1.0
    req.seq_len += 2  # root + one accepted draft: 2 tokens in a 2 s round
    pol.end_round([req])
    st = pol.state()
    assert st.step_seconds == {1: pytest.approx(1.0)} and st.seconds_per_token == {1: pytest.approx(1.0)}
    assert st.rounds_observed == 1
    # depth 1: accepted 1 of predicted mass 0.9; depth 2: 0 of 0.54
    assert pol.accepted_mass[:2] == [1.0, 0.0] and pol.predicted_mass[:2] == pytest.approx([0.9, 0.54])
    gain = pol.gain(pool, pool, children, depth=2)
    assert 0 < gain < 1.0 and pol.more(1, pool, pool, children) == "cost"  # gain x 1 s/token < 1 s
    pol.step_seconds[1] = 0.5 * gain
    assert pol.more(1, pool, pool, children) is None
    assert pol.more(1, pool, pool, torch.zeros(1, 2)) == "cost"  # no predicted gain never pays
    pol.end_round([req])  # no draft pending: nothing learnt
    assert pol.state().rounds_observed == 1


def learnt_round(pol, clock, req, cut=()) -> None:
    """One priced round of one request: a 1 s step, a 1 s rest, 2 tokens committed."""
    pol.begin()
    pol.step_begin()
    clock.t += 1.0
    pol.step_end(1)
    pol.drafted([req], torch.tensor([[0.6, 0.54, 0.3]]), torch.tensor([[1, 2, 1]]))
    clock.t += 1.0
    req.seq_len += 2
    pol.end_round([req], cut)


def test_a_cut_round_counts_for_time_not_for_calibration():
    """A request whose tree was trimmed to its budget, or whose emission was cut at EOS, could
    not accept what was drafted: its tokens time the round, its mass does not calibrate."""
    clock, req = Clock(), SimpleNamespace(request_id=7, seq_len=10)
    pol = DepthPolicy(topk=2, num_steps=3, num_draft_tokens=4, clock=clock)
    learnt_round(pol, clock, req, cut=[7])
    assert pol.accepted_mass == [0.0] * 3 and pol.predicted_mass == [0.0] * 3
    assert pol.state().seconds_per_token == {1: pytest.approx(1.0)} and pol.rounds_observed == 1
    learnt_round(pol, clock, req)  # a whole round calibrates
    assert pol.accepted_mass[0] == 1.0 and pol.predicted_mass[0] == pytest.approx(0.9)


def test_a_step_not_run_for_a_while_is_timed_again():
    """The step's cost is only measured when it runs: one that keeps losing is re-timed once
    every REMEASURE_ROUNDS rounds (the machine's load moves), then weighed as before."""
    from dsv4_tree.drafters.depth import REMEASURE_ROUNDS

    clock, req = Clock(), SimpleNamespace(request_id=1, seq_len=10)
    pol = DepthPolicy(topk=2, num_steps=3, num_draft_tokens=4, clock=clock)
    pool, children = torch.tensor([[0.6, 0.3]]), torch.tensor([[0.9, 0.05]])
    learnt_round(pol, clock, req)
    pol.step_seconds[1] = 1e9  # a step that never pays
    for _ in range(REMEASURE_ROUNDS - 1):
        assert pol.more(1, pool, pool, children) == "cost"
        pol.begin()
        pol.drafted([req], torch.tensor([[0.6, 0.3]]), torch.tensor([[1, 1]]))
        clock.t += 1.0
        req.seq_len += 1
        pol.end_round([req])
    assert pol.more(1, pool, pool, children) is None  # stale: run it once
    pol.step_begin()
    clock.t += 0.5
    pol.step_end(1)
    assert pol.more(1, pool, pool, children) == "cost"  # just timed: weighed again


def test_candidate_depths_follow_organize_numbering():
    ids = torch.tensor([0, 3, 4, 19, 20, 35, 36])  # topk 4: 4 at depth 1, then 16 per depth
    assert candidate_depths(ids, 4).tolist() == [1, 1, 2, 2, 3, 3, 4]


def test_spec_switch_resolves_and_refuses_unknown_modes():
    assert dt.SpecConfig(eagle_topk=4, num_steps=5, num_draft_tokens=8).depth_mode == "adaptive"
    assert dt.SpecConfig().depth_mode == "fixed"  # chain
    assert dt.SpecConfig(draft_depth="adaptive").depth_mode == "adaptive"
    with pytest.raises(dt.ConfigError, match="draft_depth"):
        dt.SpecConfig(draft_depth="auto")
    model = dt.load_model(dt.tiny_checkpoint())
    with pytest.raises(dt.ConfigError, match="depth"):
        MtpDrafter(model, PRESET, depth="deep")
    eng = engine(model, draft_depth="fixed")
    res = eng.generate(torch.arange(20) % 50 + 3, 3, drafter="mtp", progress=False)
    assert eng.named_drafters["mtp"].policy is None and set(res.stats.draft_steps) == {5}
    assert res.stats.steps_allowed == 5 and res.stats.depth is None
    eng = engine(model)
    eng.generate(torch.arange(20) % 50 + 3, 2, drafter="mtp", progress=False)
    assert eng.named_drafters["mtp"].policy is not None


# ---------------------------------------------------------------- the drafter, priced by a fake clock
def test_expensive_draft_steps_stop_after_step_1(trained, monkeypatch):
    model, ids, want = trained
    eng, clock = engine(model), Clock()
    drafter = MtpDrafter(model, PRESET, depth="adaptive", clock=clock)
    priced(monkeypatch, eng, clock, step=lambda rows: 1.0, verify=lambda b: 0.01)
    stops = stops_of(monkeypatch, drafter)
    res = eng.generate(ids, NEW, drafter=drafter, progress=False)
    assert res.tokens == want
    steps = res.stats.draft_steps
    # round 1 measures (nothing known: it drafts until the exact stop or num_steps); every later
    # round finds a step costing 100 verifies not worth its fraction of a token (a round right
    # after round 1, whose slow steps inflate the time per token a step is weighed against, may
    # still buy a second step)
    assert steps[0] > 1 and steps[1:].count(1) >= len(steps) - 2 and max(steps[1:]) <= 2, steps
    assert stops[1:] == ["cost"] * (len(steps) - 1), stops
    assert res.stats.depth.step_seconds == {1: pytest.approx(1.0)}


def oracle_head(monkeypatch, drafter, full, margin: float = 8.0) -> None:
    """Confident and right drafts: every draft row's logits become `margin` on the greedy
    continuation at its position (full: prompt ++ greedy output), 0 elsewhere (p ~ 0.92)."""
    current = []
    real_expand, real_head, real_rows = drafter.expand, mtp_module.head_logits, wave_module.draft_rows

    def peaked(positions, logits):
        out = torch.zeros_like(logits)
        out[torch.arange(len(positions)), full[positions.cpu() + 1]] = margin
        return out

    def expand(requests, depth=None, graphed=False):
        current[:] = [torch.tensor([r.seq_len for r in requests])]  # the root rows' positions
        return real_expand(requests, depth, graphed)

    def head(m, mtp, h):  # step 0 (the root rows)
        return peaked(current[0], real_head(m, mtp, h))

    def rows(m, mtp, ids, hidden_in, positions, *args, **kwargs):  # steps >= 1
        out = real_rows(m, mtp, ids, hidden_in, positions, *args, **kwargs)
        return MtpRows(peaked(positions, out.logits), out.hidden, out.raw)

    monkeypatch.setattr(drafter, "expand", expand)
    monkeypatch.setattr(mtp_module, "head_logits", head)
    monkeypatch.setattr(wave_module, "draft_rows", rows)


def test_free_steps_and_confident_drafts_run_every_step(trained, monkeypatch):
    model, ids, want = trained
    eng, clock = engine(model), Clock()
    drafter = MtpDrafter(model, PRESET, depth="adaptive", clock=clock)
    priced(monkeypatch, eng, clock, step=lambda rows: 0.0, verify=lambda b: 1.0)
    oracle_head(monkeypatch, drafter, torch.cat([ids, torch.tensor(want)]))
    stops = stops_of(monkeypatch, drafter)
    res = eng.generate(ids, NEW - 6, drafter=drafter, progress=False)  # drafts reach 5 past the last token
    assert res.tokens == want[: NEW - 6]
    assert set(res.stats.draft_steps) == {5} and set(stops) == {"max"}, (res.stats.draft_steps, stops)
    assert set(res.stats.accept_lengths[:-1]) == {6}  # every draft accepted: the calibration says so too
    assert all(c > 0.9 for c in res.stats.depth.calibration), res.stats.depth


def test_exact_stop_gives_the_full_depth_tree():
    # random weights draft flat distributions: with 2 draft slots, the root's best two children
    # outscore every grandchild, so after step 1 every frontier score lies below the 2nd best
    model = dt.load_model(dt.tiny_checkpoint())
    shape = TreeShape(4, 4, 3)
    eng = engine(model, shape)
    for seed in range(3):
        req = eng.prefill(torch.randint(3, 200, (30,), generator=torch.Generator().manual_seed(seed)))
        # a fresh policy has measured nothing: only the exact rule can stop it
        adaptive = MtpDrafter(model, shape, depth="adaptive", clock=Clock())
        fixed = MtpDrafter(model, shape, depth="fixed")
        got, full = adaptive.draft(eng, [req])[0], fixed.draft(eng, [req])[0]
        assert adaptive.last_round.stop == "exact" and adaptive.last_round.steps == 2, (seed, adaptive.last_round)
        assert fixed.last_round.steps == 4 and fixed.last_round.stop == "max"
        assert torch.equal(got.tokens, full.tokens) and torch.equal(got.parents, full.parents), seed
        eng.release(req)


# ---------------------------------------------------------------- outputs equal plain greedy
def test_adaptive_greedy_equals_plain_greedy_on_the_trained_checkpoint(trained):
    model, ids, want = trained
    eng = engine(model)  # real clock: whatever depths this machine's timings choose
    res = eng.generate(ids, NEW, drafter="mtp", progress=False)
    assert res.tokens == want
    st = res.stats
    assert len(st.draft_steps) == st.rounds == len(st.round_draft_seconds) == len(st.round_verify_seconds)
    assert all(1 <= s <= 5 for s in st.draft_steps) and st.steps_allowed == 5
    assert st.depth.rounds_observed == st.rounds  # every round, the budget-cut last one too
    assert set(st.depth.step_seconds) == {1} and len(st.depth.calibration) == 5


def test_adaptive_greedy_equals_plain_greedy_on_random_weights(monkeypatch):
    """Random weights accept nothing they draft, so the draft head is made right (oracle_head,
    a low margin: flat enough that the exact stop rarely fires) and the step's price jumps
    after a few rounds: full-depth trees, then short ones, both accepted from, equal greedy."""
    model = dt.load_model(dt.tiny_checkpoint())
    ids = torch.randint(3, 200, (40,), generator=torch.Generator().manual_seed(4))
    new = 30
    want = hf_greedy(model, ids, new)
    eng, clock = engine(model), Clock()
    drafter = MtpDrafter(model, PRESET, depth="adaptive", clock=clock)
    verifies = []
    priced(monkeypatch, eng, clock, step=lambda rows: 0.0 if len(verifies) < 3 else 10.0,
           verify=lambda b: verifies.append(b) or 0.01)
    oracle_head(monkeypatch, drafter, torch.cat([ids, torch.tensor(want)]), margin=3.0)
    res = eng.generate(ids, new, drafter=drafter, progress=False)
    assert res.tokens == want
    steps, accepted = res.stats.draft_steps, res.stats.accept_lengths
    assert len(set(steps)) >= 2 and max(steps) >= 3 and min(steps) == 1, steps
    assert max(accepted) > 2 and sum(a > 1 for a, s in zip(accepted, steps) if s == 1) >= 1, (steps, accepted)


def test_batch_rounds_choose_depth_per_batch_size_and_equal_plain_greedy(trained, monkeypatch):
    model, _, _ = trained
    prompts = [heldout_prompt(100, 10 + i) for i in range(3)]
    budgets = [6, 20, 12]
    wants = [hf_greedy(model, torch.tensor(p), n) for p, n in zip(prompts, budgets)]
    eng, clock = engine(model), Clock()
    drafter = MtpDrafter(model, PRESET, depth="adaptive", clock=clock)
    # a draft step over >= 8 frontier rows (2+ requests) costs 1 s, over 4 rows (1 request) nothing
    priced(monkeypatch, eng, clock, step=lambda rows: 1.0 if rows >= 8 else 0.0, verify=lambda b: 0.01)
    results = eng.generate_batch(prompts, budgets, drafter=drafter, progress=False)
    assert [r.tokens for r in results] == wants
    longest = results[1].stats  # in every round; its requests finish at different rounds
    assert min(longest.draft_steps) == 1 and max(longest.draft_steps) > 2, longest.draft_steps
    assert set(longest.depth.step_seconds) >= {1, 2}
    assert longest.depth.step_seconds[2] == pytest.approx(1.0)
