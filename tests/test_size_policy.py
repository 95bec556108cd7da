"""The DSpark tree size policy: on a fake clock it grows the tree when verify rows are cheap and
the values high, shrinks it when rows are dear, probes until its cost line rests on two sizes,
never exceeds num_draft_tokens (or the pool), and leaves greedy output equal to Hugging Face's."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import dsv4_tree as dt
from dsv4_tree.checkpoint.dspark import DSparkSettings
from dsv4_tree.checkpoint.tiny import random_dspark
from dsv4_tree.drafters.base import TreeShape
from dsv4_tree.drafters.depth import candidate_depths
from dsv4_tree.drafters.dspark import DSparkDrafter
from dsv4_tree.drafters.size_policy import PROBE_EVERY, STALE, WINDOW, CostLine, SizePolicy
from test_adaptive_depth import Clock, hf_greedy

TOPK, STEPS, N = 2, 3, 10
POOL = TOPK + (STEPS - 1) * TOPK**2  # 10 candidates
DEPTHS = candidate_depths(torch.arange(POOL), TOPK).numpy()


def _values(batch: int, conf: float) -> np.ndarray:
    """A pool whose candidates are worth conf ** depth (rank 0) and a tenth of it (the rest)."""
    rank0 = np.arange(POOL) % TOPK == 0
    return np.tile(np.where(rank0, 1.0, 0.1) * conf ** DEPTHS, (batch, 1))


def _measured(a: float, b: float) -> SizePolicy:
    """A policy whose batch-1 line is seconds = a + b * nodes (two sizes measured)."""
    pol = SizePolicy(STEPS, N)
    line = pol.costs.setdefault(1, CostLine())
    for n in (N, 4, N, 4):
        line.add(n, a + b * n)
    line.last_probe = line.rounds  # no probe due
    assert pol.costs[1].line() == pytest.approx((a, b))
    return pol


def test_it_grows_when_rows_are_cheap_and_values_high_and_shrinks_when_rows_are_dear():
    cheap, dear = _measured(1.0, 0.01), _measured(1.0, 0.5)
    high, low = _values(1, 0.95), _values(1, 0.3)
    assert cheap.choose(high, DEPTHS) == N
    assert dear.choose(high, DEPTHS) < cheap.choose(high, DEPTHS)
    assert cheap.choose(low, DEPTHS) < cheap.choose(high, DEPTHS)
    assert dear.choose(low, DEPTHS) == 1  # nothing drafted is worth half a round per node
    # the choice maximises expected tokens / seconds over every size
    vals = np.sort(high[0])[::-1]
    rates = [(1 + vals[: n - 1].sum()) / (1.0 + 0.5 * n) for n in range(1, N + 1)]
    assert dear.choose(high, DEPTHS) == int(np.argmax(rates)) + 1


def test_it_never_exceeds_the_node_limit_or_the_pool():
    free = _measured(1.0, 0.0)
    assert free.choose(_values(3, 0.99), DEPTHS) == N
    wide = SizePolicy(STEPS, 64)
    line = wide.costs.setdefault(2, CostLine())
    line.add(64, 1.0)
    line.add(5, 1.0)
    line.last_probe = line.rounds
    assert wide.choose(_values(2, 0.99), DEPTHS) == POOL + 1  # 11 nodes: every candidate
    assert SizePolicy(STEPS, 64).choose(_values(2, 0.99), DEPTHS) == POOL + 1  # the first probe too


def test_it_probes_until_its_line_rests_on_two_sizes_then_keeps_both_ends_measured():
    pol = SizePolicy(STEPS, N)
    assert pol.choose(_values(1, 0.9), DEPTHS) == N  # nothing measured: the full tree
    line = pol.costs.setdefault(1, CostLine())
    line.add(N, 1.1)
    assert line.line() is None
    assert pol.choose(_values(1, 0.9), DEPTHS) == (N + 1) // 2  # one size measured: half of it
    line.add(5, 1.05)
    assert line.line() == pytest.approx((1.0, 0.01))
    picks = []
    for _ in range(2 * PROBE_EVERY):  # cheap rows: the full tree, with a half-size probe every PROBE_EVERY rounds
        n = pol.choose(_values(1, 0.9), DEPTHS)
        picks.append(n)
        line.add(n, 1.0 + 0.01 * n)
    assert picks.count((N + 1) // 2) == 2 and picks.count(N) == 2 * PROBE_EVERY - 2
    assert set(line.samples) == {N, 5} and line.line() == pytest.approx((1.0, 0.01))


def test_the_line_goes_through_each_sizes_median_and_forgets_stale_samples():
    line = CostLine()
    for t in (1.0, 1.0, 9.0, 1.0):  # a load spike: the median ignores it
        line.add(2, t)
    for t in (2.0, 2.0, 2.0):
        line.add(6, t)
    assert line.line() == pytest.approx((0.5, 0.25))
    assert all(len(v) <= WINDOW for v in line.samples.values())
    for _ in range(STALE):
        line.add(6, 2.0)
    assert set(line.samples) == {6} and line.line() is None  # size 2's samples went stale: probe again
    down = CostLine()
    down.add(2, 3.0)
    down.add(6, 1.0)
    assert down.line() == (pytest.approx(2.0), 0.0)  # never a negative cost per node


def test_end_round_times_the_round_at_its_size_and_calibrates_uncut_requests():
    clock = Clock()
    pol = SizePolicy(STEPS, N, clock=clock)

    class Req:
        def __init__(self, rid, seq_len):
            self.request_id, self.seq_len = rid, seq_len

    a, b = Req(1, 10), Req(2, 20)
    pol.begin()
    pol.drafted([a, b], 3, np.array([[0.9, 0.5], [0.8, 0.4]]), np.array([[1, 2], [1, 1]]))
    clock.t += 0.25
    a.seq_len, b.seq_len = 13, 21  # a accepted 2 drafts, b none
    pol.end_round([a, b], cut=[2])
    assert 2 not in pol.costs  # b's round was cut short: the round is not timed at its size
    assert pol.accepted_mass[:2] == [1.0, 1.0] and pol.predicted_mass[:2] == pytest.approx([0.9, 0.5])
    assert pol.state().last_nodes == 3 and pol.state().rounds_observed == 1
    pol.begin()
    pol.drafted([a, b], 2, np.array([[0.5], [0.5]]), np.array([[1], [1]]))
    clock.t += 0.5
    a.seq_len, b.seq_len = 14, 23
    pol.end_round([a, b])
    assert pol.costs[2].samples == {2: [(1, pytest.approx(0.5))]}
    assert pol.accepted_mass[0] == pytest.approx(0.98 + 1) and pol.state().rounds_observed == 2


@pytest.fixture(scope="module")
def model():
    return dt.load_model(dt.tiny_checkpoint())


def test_the_drafter_follows_the_fake_clock_and_greedy_output_stays_hugging_faces(model, monkeypatch):
    """Verify priced per row: cheap rows give full trees, dear rows small ones; the output is
    Hugging Face's greedy tokens either way."""
    module = random_dspark(model.config, DSparkSettings(4, 8, model.vocab_size - 5, (1, 2, 3)), seed=3)
    prompt = torch.randint(2, 500, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    want = hf_greedy(model, prompt, 40)
    sizes = {}
    for label, per_row in (("cheap", 1e-4), ("dear", 1.0)):
        clock = Clock()
        eng = dt.Engine(model, dt.SpecConfig(eagle_topk=TOPK, num_steps=STEPS, num_draft_tokens=N))
        assert eng.spec.depth_mode == "adaptive"
        drafter = DSparkDrafter(model, TreeShape(TOPK, STEPS, N), module=module, clock=clock)
        real_verify = eng.verify

        def priced(reqs, trees, *args, _real=real_verify, _per=per_row, _clock=clock, **kwargs):
            _clock.t += 1.0 + _per * sum(t.num_nodes for t in trees)
            return _real(reqs, trees, *args, **kwargs)

        monkeypatch.setattr(eng, "verify", priced)
        seen, real_draft = [], drafter.draft

        def draft(engine, requests, _real=real_draft, _seen=seen):
            trees = _real(engine, requests)
            _seen.append(trees[0].num_nodes)
            return trees

        monkeypatch.setattr(drafter, "draft", draft)
        res = eng.generate(prompt, 40, drafter=drafter, progress=False)
        assert res.tokens == want, label
        assert max(seen) <= N and seen[:2] == [N, (N + 1) // 2], (label, seen)  # the two probes
        sizes[label] = seen[2:]
        assert res.stats.depth is not None and res.stats.depth.rounds_observed >= len(seen) - 1
    # apart from the probe every PROBE_EVERY rounds (the far end of the range), dear rows get the
    # root alone and cheap rows larger trees
    median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    assert median(sizes["dear"]) == 1 and median(sizes["cheap"]) > 3, sizes
