"""The batch verify budget's pure parts: the pick over tree nodes is ancestor-closed, within each
request's cap and the best b in one fixed order; the budget is theta's argmax over every b; the
cost tables read and interpolate as documented, and refuse malformed files by field; online
lines go through medians and forget stale samples. (Equality with SGLang 0.5.23's own chain
schedule and budget: tests/with_sglang/test_sglang_verify_budget.py.)"""
from __future__ import annotations

import json

import pytest
import torch

import dsv4_tree as dt
from dsv4_tree.budget.budget_policy import BudgetPolicy
from dsv4_tree.budget.cost_table import (STALE, WINDOW, AdditiveTable, CostLine, LineTable, StepsPerSecondTable,
                                           load_cost_table)
from dsv4_tree.drafters.depth import candidate_depths
from dsv4_tree.budget.verify_budget import budget_from_sorted, eligible, pick_nodes, verify_lens

K, STEPS = 3, 3
P = K + (STEPS - 1) * K * K
DEPTHS = candidate_depths(torch.arange(P), K)


def _pool(g: torch.Generator, r: int):
    """Random ancestor-monotone pools in organize_draft_results' layout -> (values [r, P], parents [r, P])."""
    values, parents = torch.zeros(r, P, dtype=torch.float64), torch.full((r, P), -1)
    values[:, :K] = torch.rand(r, K, generator=g, dtype=torch.float64)
    values[0, 1] = values[1, 0] = values[1, 2] = 0.5  # ties across requests
    for b in range(r):
        for d in range(2, STEPS + 1):
            start = K + (d - 2) * K * K
            prev = range(0, K) if d == 2 else range(start - K * K, start)
            front = torch.tensor(list(prev))[torch.randperm(len(prev), generator=g)[:K]]
            for f, par in enumerate(front.tolist()):
                at = slice(start + f * K, start + (f + 1) * K)
                parents[b, at] = par
                values[b, at] = values[b, par] * torch.rand(K, generator=g, dtype=torch.float64)
                values[b, start + f * K] = values[b, par]  # a child worth its parent: depth breaks the tie
    return values, parents


def test_the_pick_is_ancestor_closed_capped_and_the_best_b_in_one_order():
    g = torch.Generator().manual_seed(0)
    values, parents = _pool(g, 4)
    for cap in (1, 3, 7, P):
        pick = eligible(values, DEPTHS, cap)
        key = [(-float(values.view(-1)[i]), int(DEPTHS[i % P]), int(i // P), int(i % P)) for i in pick.order]
        assert key == sorted(key)  # value, then depth, then request, then candidate id
        for b in range(0, pick.order.numel() + 2):
            chosen = pick_nodes(pick, values.shape, b)
            assert int(chosen.sum()) == min(b, pick.order.numel())
            assert (chosen.sum(1) <= cap).all()
            par = parents.clamp(min=0)
            assert bool((~chosen | (parents < 0) | chosen.gather(1, par)).all()), "a chosen node's parent is missing"
    # a request at its cap takes nothing more, however good its later candidates
    assert (pick_nodes(eligible(values, DEPTHS, 2), values.shape, 10**6).sum(1) == 2).all()


def test_the_budget_is_thetas_argmax_over_every_b():
    table = LineTable((1, 8), (1.0, 2.0), (0.05, 0.2))
    g = torch.Generator().manual_seed(1)
    for r in (1, 3, 8, 12):
        vals = torch.sort(torch.rand(20, generator=g, dtype=torch.float64), descending=True).values
        base, per = table.line(r)
        rates = [(r + float(vals[:b].sum())) / (base + per * (r + b)) for b in range(21)]
        got = budget_from_sorted(vals, r, table)
        assert got.budget == max(range(21), key=lambda b: (rates[b], -b))
        assert got.seconds == pytest.approx(base + per * (r + got.budget))
    assert table.line(4) == pytest.approx((1 + 3 / 7, 0.05 + 0.15 * 3 / 7)) and table.line(20) == (2.0, 0.2)


def test_chain_lengths_are_the_batchs_best_survival():
    conf = torch.tensor([[0.9, 0.9, 0.1], [0.5, 0.5, 0.5]])  # survival [.9 .81 .081], [.5 .25 .125]
    assert verify_lens(conf, 0).tolist() == [1, 1]
    assert verify_lens(conf, 3).tolist() == [3, 2]
    assert verify_lens(conf, 6).tolist() == [4, 4]


def test_cost_tables_load_from_our_and_sglangs_json_and_refuse_bad_fields(tmp_path):
    line = LineTable((1, 4), (0.01, 0.02), (1e-4, 2e-4), note="test")
    line.save(tmp_path / "lines.json")
    assert load_cost_table(tmp_path / "lines.json") == line
    sps = {"sample_batch_tokens": [1, 8], "sample_steps_per_sec": [90.0, 60.0], "max_batch_tokens": 64}
    add = {"bias_seconds": 0.002, "bs_probes": [1, 4], "alpha_seconds": [0.0, 0.001], "m_probes": [1, 32],
           "theta_seconds": [0.0, 0.004]}
    for name, data, cls in (("sps", sps, StepsPerSecondTable), ("add", add, AdditiveTable)):
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
        assert isinstance(load_cost_table(tmp_path / f"{name}.json"), cls)
    tau = torch.tensor([1.0, 1.5, 1.75], dtype=torch.float64)
    theta, secs = load_cost_table(tmp_path / "sps.json").theta(tau, 7)  # 7, 8, 9 tokens: floor lookup
    assert theta.tolist() == [90.0, 1.5 * 60, 1.75 * 60]
    bad = {**sps, "sample_batch_tokens": [8, 1]}
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(dt.ConfigError, match="sample_batch_tokens must be strictly increasing"):
        load_cost_table(tmp_path / "bad.json")
    (tmp_path / "missing.json").write_text(json.dumps({"format": "dsv4_tree.cost_lines", "batch_sizes": [1]}))
    with pytest.raises(dt.ConfigError, match="lacks .*base_seconds"):
        load_cost_table(tmp_path / "missing.json")
    with pytest.raises(dt.ConfigError, match="not found"):
        load_cost_table(tmp_path / "none.json")


def test_online_lines_go_through_medians_and_forget_stale_samples():
    line = CostLine()
    for t in (1.0, 1.0, 9.0, 1.0):  # a load spike: the median ignores it
        line.add(2, t)
    for t in (2.0, 2.0, 2.0):
        line.add(6, t)
    assert line.line() == pytest.approx((0.5, 0.25))
    assert all(len(v) <= WINDOW for v in line.samples.values())
    for _ in range(STALE):
        line.add(6, 2.0)
    assert set(line.samples) == {6} and line.line() is None  # total 2's samples went stale: probe again
    down = CostLine()
    down.add(2, 3.0)
    down.add(6, 1.0)
    assert down.line() == (pytest.approx(2.0), 0.0)  # never a negative cost per node


def test_an_unpriced_batch_size_probes_the_full_then_the_half_budget():
    class Req:
        def __init__(self, rid):
            self.request_id, self.seq_len = rid, 10

    clock = iter(range(1000)).__next__
    pol = BudgetPolicy(cap=4, clock=lambda: float(clock()))
    model = type("M", (), {"ranks": None})()
    values = torch.rand(2, P, dtype=torch.float64) * 0.5 + 0.5
    reqs = [Req(1), Req(2)]
    got = []
    for _ in range(3):
        pol.begin()
        chosen = pol.tree(model, values, DEPTHS)
        got.append(int(chosen.sum()))
        pol.drafted(reqs, len(reqs) + got[-1])
        for r in reqs:
            r.seq_len += 1
        pol.end_round(reqs)
    assert got[:2] == [8, 4] and pol.costs.ready(2)
