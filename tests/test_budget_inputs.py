"""Malformed verify-budget inputs are refused by name, at load or at call, with a ConfigError: cost
tables (budget/cost_table.py), node-value models (budget/node_values.py) and profile_costs'
arguments (budget/cost_profile.py). Before, each of these loaded and then failed at the first
adaptive draft with a raw TypeError / ValueError / AttributeError, or (a NaN in a table) switched
speculation off silently: every round verified the root alone."""
from __future__ import annotations

import json

import pytest
import torch

import dsv4_tree as dt
from dsv4_tree.drafters.base import TreeShape
from dsv4_tree.budget.cost_profile import profile_costs
from dsv4_tree.budget.cost_table import AdditiveTable, LineTable, load_cost_table
from dsv4_tree.drafters.dspark import DSparkDrafter
from dsv4_tree.budget.node_values import FEATURES, ValueModel
from test_budget_policy import GAMMA, TREE, model, module  # noqa: F401 (the tiny model and a DSpark module: fixtures)

LINES = {"format": "dsv4_tree.cost_lines", "batch_sizes": [1, 4], "base_seconds": [0.01, 0.02],
         "seconds_per_node": [0.001, 0.001]}
ADDITIVE = {"bias_seconds": 0.01, "bs_probes": [1, 4], "alpha_seconds": [0.001, 0.002], "m_probes": [1, 16],
            "theta_seconds": [0.001, 0.004]}
SPS = {"sample_batch_tokens": [1, 8], "sample_steps_per_sec": [100.0, 50.0], "max_batch_tokens": 64}
NAN = float("nan")
BAD_TABLES = [  # (good table, field, bad value)
    (LINES, "batch_sizes", ["1", "4"]),
    (LINES, "base_seconds", [0.01, NAN]),
    (LINES, "seconds_per_node", [0.001, -0.001]),
    (LINES, "batch_sizes", "14"),
    (ADDITIVE, "bs_probes", ["a", "b"]),
    (ADDITIVE, "alpha_seconds", [NAN, 0.002]),
    (ADDITIVE, "theta_seconds", [0.001, float("inf")]),
    (ADDITIVE, "bias_seconds", NAN),
    (ADDITIVE, "m_probes", [1, True]),
    (SPS, "sample_steps_per_sec", ["fast", "slow"]),
    (SPS, "sample_steps_per_sec", [100.0, -50.0]),
    (SPS, "sample_steps_per_sec", [100.0, 0.0]),
    (SPS, "sample_batch_tokens", [1, NAN]),
    (SPS, "max_batch_tokens", "64"),
]


@pytest.mark.parametrize("good,field,bad", BAD_TABLES, ids=[f"{f}={b!r}" for _, f, b in BAD_TABLES])
def test_a_malformed_cost_table_is_refused_at_load_naming_file_and_field(tmp_path, good, field, bad):
    path = tmp_path / "table.json"
    path.write_text(json.dumps(good))
    load_cost_table(path)  # the unchanged table loads
    path.write_text(json.dumps({**good, field: bad}))  # json writes NaN / Infinity as Python reads them
    with pytest.raises(dt.ConfigError, match=f"{path}.*{field}"):
        load_cost_table(path)


def test_tables_built_in_python_are_checked_the_same_way():
    with pytest.raises(dt.ConfigError, match="alpha_seconds"):
        AdditiveTable(0.01, (1, 4), (NAN, 0.002), (1, 16), (0.001, 0.004))
    with pytest.raises(dt.ConfigError, match="batch_sizes"):
        LineTable(("1", "4"), (0.01, 0.02), (0.001, 0.001))


WEIGHTS = [0.5] * len(FEATURES)
BAD_VALUE_JSON = [
    json.dumps({"features": list(FEATURES), "weights": "12345"}),  # a string is not five weights
    json.dumps({"features": list(FEATURES), "weights": WEIGHTS[:-1]}),
    json.dumps({"features": list(FEATURES), "weights": ["a"] * len(FEATURES)}),
    json.dumps({"features": list(FEATURES), "weights": [NAN] * len(FEATURES)}),
    json.dumps({"features": list(FEATURES), "weights": {"a": 1}}),
    json.dumps({"features": ["other"], "weights": WEIGHTS}),
    json.dumps([1, 2, 3]),
    "{not json",
    "",
]


@pytest.mark.parametrize("text", BAD_VALUE_JSON)
def test_a_malformed_value_model_is_refused_by_name(text):
    assert ValueModel.from_json(json.dumps({"features": list(FEATURES), "weights": WEIGHTS})).weights == tuple(WEIGHTS)
    with pytest.raises(dt.ConfigError, match="ValueModel"):
        ValueModel.from_json(text)


def test_value_model_from_json_refuses_what_is_not_text():
    with pytest.raises(dt.ConfigError, match="JSON text"):
        ValueModel.from_json({"features": list(FEATURES), "weights": WEIGHTS})


def test_the_drafter_takes_a_value_model_its_json_or_a_path(model, module, tmp_path):
    fitted = ValueModel(tuple(WEIGHTS))
    path = tmp_path / "values.json"
    path.write_text(fitted.to_json())
    for given in (fitted, fitted.to_json(), path, str(path)):
        assert DSparkDrafter(model, TREE, module=module, values=given).values.model == fitted
    for bad, match in ((tuple(WEIGHTS), "values must be"), (0.5, "values must be"),
                       (json.dumps({"features": list(FEATURES), "weights": "12345"}), "weights"),
                       (tmp_path / "missing.json", "cannot read")):
        with pytest.raises(dt.ConfigError, match=match):
            DSparkDrafter(model, TREE, module=module, values=bad)


@pytest.mark.parametrize("kwargs,match", [
    (dict(batch_sizes=()), "batch_sizes"), (dict(batch_sizes=(1.5,)), "batch_sizes"),
    (dict(batch_sizes=(0, 1)), "batch_sizes"), (dict(batch_sizes="14"), "batch_sizes"),
    (dict(rounds=0), "rounds"), (dict(rounds=1.5), "rounds"),
])
def test_profile_costs_refuses_bad_arguments_by_name(model, module, kwargs, match):
    eng = dt.Engine(model, dt.SpecConfig(eagle_topk=1, num_steps=GAMMA, num_draft_tokens=GAMMA + 1))
    drafter = DSparkDrafter(model, TreeShape(1, GAMMA, GAMMA + 1), module=module, size="adaptive")
    prompts = [torch.arange(2, 12).tolist()] * 4
    with pytest.raises(dt.ConfigError, match=match):
        profile_costs(eng, drafter, prompts, **{"batch_sizes": (1,), "rounds": 1, **kwargs})
    assert eng.runtime.pages.free_rows == eng.spec.max_requests  # nothing was prefilled
