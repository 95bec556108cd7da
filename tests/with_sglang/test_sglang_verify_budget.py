"""Our confidence-scheduled DSpark verify (budget/verify_budget.py, budget_policy.py, cost_table.py) against
SGLang 0.5.23's own scheduler on the same confidences and cost tables: `schedule_verify_lens_topk`
(torch path), `compute_verify_token_budget` (both table kinds) and the host planner's two-step
lag (`HostConfidenceBudgetPlanner.compute_budget`, overlap off), step by step; and the table files
SGLang's profiler writes, loaded by `load_cost_table`."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dsv4_tree.budget.budget_policy import BudgetPolicy
from dsv4_tree.budget.cost_table import AdditiveTable, StepsPerSecondTable
from dsv4_tree.budget.verify_budget import choose_budget, survival, verify_lens


def _confidences(g: torch.Generator, r: int, gamma: int) -> torch.Tensor:
    """Uniform confidences with exact ties (a few values repeated) and some below survival_eps."""
    c = torch.rand(r, gamma, generator=g)
    tied = torch.rand(r, gamma, generator=g) < 0.3
    c = torch.where(tied, torch.tensor([0.5, 0.9, 1.0])[torch.randint(0, 3, (r, gamma), generator=g)], c)
    tiny = torch.rand(r, gamma, generator=g) < 0.1
    c = torch.where(tiny, torch.full_like(c, 1e-7), c)
    c[: min(r, 2), : max(1, gamma - 1)] = 1.0  # equal survival across requests and positions: the tie order decides
    return c


def _tables(g: torch.Generator, gamma: int):
    """The same random price list as SGLang's table objects and ours."""
    from sglang.srt.speculative.dspark_components.dspark_sps import SpsAdditiveCostTable, SpsCostTable

    probes = sorted(set(torch.randint(1, 6 * (gamma + 1), (5,), generator=g).tolist()) | {1})
    sps = (200.0 / (1 + 0.05 * torch.tensor(probes, dtype=torch.float64)) * (1 + 0.2 * torch.rand(len(probes), generator=g,
                                                                                                   dtype=torch.float64))).tolist()
    bs, m = [1, 2, 4, 8], sorted(set(torch.randint(1, 60, (4,), generator=g).tolist()))
    alpha = (1e-3 * torch.rand(4, generator=g, dtype=torch.float64)).tolist()
    theta = (1e-4 * torch.tensor(m, dtype=torch.float64) * (1 + torch.rand(len(m), generator=g, dtype=torch.float64))).tolist()
    bias = 4e-3
    sg = [SpsCostTable(sample_batch_tokens=probes, sample_steps_per_sec=sps, max_batch_tokens=probes[-1] + 10),
          SpsAdditiveCostTable(bias_seconds=bias, bs_probes=bs, alpha_seconds=alpha, m_probes=m, theta_seconds=theta)]
    ours = [StepsPerSecondTable(tuple(probes), tuple(sps), probes[-1] + 10),
            AdditiveTable(bias, tuple(bs), tuple(alpha), tuple(m), tuple(theta))]
    return list(zip(sg, ours))


@pytest.mark.parametrize("seed", range(4))
def test_schedule_and_budget_equal_sglangs(seed):
    from sglang.kernels.ops.speculative.dspark.dspark_schedule import schedule_verify_lens_topk
    from sglang.srt.speculative.dspark_components.dspark_planner import (DSparkScheduleConfig,
                                                                        compute_verify_token_budget)

    g = torch.Generator().manual_seed(seed)
    gamma = (5, 3, 7, 1)[seed]
    for r in (1, 3, 8):
        conf = _confidences(g, r, gamma)
        for cfg in (DSparkScheduleConfig(gamma=gamma), DSparkScheduleConfig(gamma=gamma, min_verify_len=0),
                    DSparkScheduleConfig(gamma=gamma, min_verify_len=2, max_verify_len=min(gamma + 1, 3))):
            for budget in (0, 1, 2, r * gamma // 2, r * gamma, r * gamma + 3):
                want = schedule_verify_lens_topk(confidence=conf, budget=budget, cfg=cfg)
                got = verify_lens(conf, budget, cfg.min_verify_len, cfg.resolved_max_verify_len())
                assert got.tolist() == want.tolist(), (r, budget, cfg)
        for sg_table, table in _tables(g, gamma):
            surv = survival(_confidences(g, r, gamma))
            want = compute_verify_token_budget(history_survival_probs=surv, sps_table=sg_table,
                                               cfg=DSparkScheduleConfig(gamma=gamma))
            got = choose_budget(surv, table)
            assert got.budget == want.budget and got.theta == want.predicted_theta, (r, type(table).__name__)
            assert got.seconds == pytest.approx(want.predicted_step_seconds, rel=1e-12)


def test_the_lagged_budget_follows_sglangs_host_planner_step_by_step(monkeypatch):
    """Requests in fixed pool slots (SGLang's generation counter = our request id), one replaced
    half-way: both planners see the same confidences each step and give the same budget."""
    from sglang.srt.speculative.dspark_components.dspark_planner import DSparkScheduleConfig, HostConfidenceBudgetPlanner

    g = torch.Generator().manual_seed(7)
    gamma, slots = 5, 4
    sg_table, table = _tables(g, gamma)[1]
    runner = SimpleNamespace(req_to_token_pool=SimpleNamespace(req_to_token=torch.zeros(slots, 1)))
    sg = HostConfidenceBudgetPlanner(sps_table=sg_table, cfg=DSparkScheduleConfig(gamma=gamma), model_runner=runner,
                                     relay_lag_steps=0)
    assert sg.lag_steps == 2 and sg.carry_steps == 2
    ours = BudgetPolicy(cap=gamma, table=table)
    model = SimpleNamespace(ranks=None)
    generation = torch.ones(slots, dtype=torch.int64)
    ids = list(range(100, 100 + slots))
    budgets = []
    for step in range(10):
        if step == 4:  # slot 2 gets a new request: its survival counts as 1 for two steps
            generation[2] += 1
            ours.forget(ids[2])
            ids[2] = 200
        conf = _confidences(g, slots, gamma)
        want = sg.compute_budget(confidence=conf, generation=generation.clone(), current_generation=generation,
                                 req_pool_indices_cpu=torch.arange(slots))
        lens = ours.chain(model, ids, conf)
        assert ours.last_budget == want, step
        assert lens.tolist() == verify_lens(conf, want).tolist()
        budgets.append(want)
    assert len(set(budgets)) > 2, budgets  # the inputs move the budget: the comparison bites


def test_sglangs_own_table_files_load_as_our_tables(tmp_path):
    """What SGLang's profiler writes (its tables' to_json) loads as the same price list here."""
    from dsv4_tree.budget.cost_table import load_cost_table

    g = torch.Generator().manual_seed(3)
    for i, (sg_table, table) in enumerate(_tables(g, 4)):
        path = tmp_path / f"table{i}.json"
        path.write_text(sg_table.to_json())
        assert load_cost_table(path) == table
