"""Benchmarks run without the optional `bench` extra: plotting is skipped with a one-line
note and the JSON line is still printed last."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from child_blocker import blocker_source

ROOT = Path(__file__).resolve().parents[1]

# Makes matplotlib uninstalled in the child: every finder returns nothing for it.
BLOCK_AND_RUN = "import runpy, sys\n" + blocker_source("matplotlib") + r"""
block()
script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
"""


def test_bench_verify_without_matplotlib(tmp_path):
    png = tmp_path / "plot.png"
    args = ["benchmarks/bench_verify.py", "--quick", "--shapes", "tiny", "--contexts", "64", "--nodes", "2",
            "--layers", "3", "--plot", str(png)]
    # the malloc variables are what the script would re-exec itself with (that would drop the blocker)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    out = subprocess.run([sys.executable, "-c", BLOCK_AND_RUN, *args], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    notes = [line for line in lines if line.startswith("plot:")]
    assert len(notes) == 1 and "matplotlib is not installed" in notes[0], lines
    assert not png.exists()
    data = json.loads(lines[-1])
    assert data["context"] == 64 and data["N"] == 2 and len(data["records"]) == 1, data
    rec = data["records"][0]
    assert rec["floor_s"] == max(rec["floor_weights_s"] + rec["floor_kv_s"], rec["floor_flops_s"]) > 0
    assert rec["tree_over_floor"] == rec["tree_s"] / rec["floor_s"]


def _load(name):
    import importlib.util

    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_plan_quick_one_copy_per_step_and_flat_op_counts(capsys):
    _load("bench_plan").main(["--quick"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    recs = out["records"]
    assert len(recs) == 4 and all(r["h2d_copies"] == 1 for r in recs), recs
    assert len({r["build_ops"] for r in recs}) == 1, recs  # the build: the same ops at 4K and 64K, bs 1 and 4
    ratio = [v for k, v in out["ratios"].items() if k.startswith("ops(65536)/ops(4096)")]
    assert ratio and ratio[0] <= 1.1, out["ratios"]


def test_roofline_of_the_bench_model_is_its_weights_at_short_context():
    """The Flash-shaped bench model's floor at 64K, bs 1, N 8 is its bf16 weights (~796 MB) at
    4.3 TB/s, about 0.19 ms (the count in the project's GPU-gap notes)."""
    bench_plan, roofline = _load("bench_plan"), _load("roofline")
    import dsv4_tree as dt

    engine = dt.Engine(bench_plan.meta_model(3), dt.SpecConfig(eagle_topk=4, num_steps=8, num_draft_tokens=8,
                                                               max_requests=1, max_total_tokens=70000,
                                                               kv_cache_dtype="fp8_e4m3"))
    fl = roofline.step_floor(engine, [65536], [8])
    assert 0.17e-3 < fl.weights_s < 0.20e-3 and fl.kv_s < 0.1 * fl.weights_s and fl.seconds == fl.weights_s + fl.kv_s


def _bench_accept():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_accept", ROOT / "benchmarks" / "bench_accept.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_accept_small_run_matches_hf_in_every_case(capsys):
    bench = _bench_accept()
    bench.main(["--prompts", "1", "--prompt-len", "64", "--new-tokens", "6", "--budgets", "4",
                "--batch-sizes", "1,2", "--batch-new-tokens", "5", "--repeats", "2"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["repeats"] == 2
    cases = {r["case"]: r for r in out["records"]}
    assert {"no speculation (1-node chain)", "chain MTP N=4", "tree MTP N=4 topk 4",
            "preset tree, adaptive (max 5)", "preset tree, fixed 5 steps", "generate_batch x2 preset, adaptive"} <= set(cases)
    assert all(r["output_equals_hf"] for r in out["records"]), out["records"]
    assert cases["no speculation (1-node chain)"]["tokens_per_verify"] == 1.0
    assert cases["preset tree, fixed 5 steps"]["draft_steps_per_round"] == 5.0
    adaptive = cases["preset tree, adaptive (max 5)"]
    assert adaptive["steps_allowed"] == 5 and 1 <= adaptive["draft_steps_per_round"] <= 5
    assert adaptive["draft_ms_per_round"] > 0 and adaptive["verify_ms_per_round"] > 0


def test_bench_accept_timing_takes_the_fastest_and_refuses_changing_outputs():
    bench = _bench_accept()
    calls = iter([[1], [1], [1]])
    out, secs = bench.timed(3, lambda: next(calls))
    assert out == [1] and secs >= 0
    calls = iter([[1], [2]])
    with pytest.raises(RuntimeError, match="different outputs"):
        bench.timed(2, lambda: next(calls))
    order = []  # several jobs take turns in every repeat
    job = lambda x: order.append(x) or [x]  # noqa: E731
    got = bench.timed_rounds(2, [(job, ("a",)), (job, ("b",))])
    assert order == ["a", "b", "a", "b"] and [out for out, _ in got] == [["a"], ["b"]]


def test_bench_hf_generate_small_run_is_identical_to_hf(capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_hf_generate", ROOT / "benchmarks" / "bench_hf_generate.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--prompts", "1", "--prompt-len", "64", "--new-tokens", "6", "--batch", "2", "--repeats", "1"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    cases = {r["case"]: r for r in out["records"]}
    assert cases["custom_generate"]["output_identical"] and cases["custom_generate, padded batch x2"]["output_identical"]
    assert out["cpu"] and all(r["tokens"] > 0 for r in out["records"])


def test_bench_accept_counts_ops_per_token(capsys):
    """--count-ops: every single-request case gets aten ops per generated token, and the count
    is what OpCounter gives over the same job (fixed depth: the op sequence repeats exactly)."""
    import dsv4_tree as dt
    from dsv4_tree.diagnostics import OpCounter
    from dsv4_tree.train.corpus import heldout_prompt

    bench = _bench_accept()
    bench.main(["--prompts", "1", "--prompt-len", "64", "--new-tokens", "6", "--budgets", "4",
                "--batch-sizes", "", "--repeats", "1", "--count-ops"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert "ops/token" in lines[1]
    cases = {r["case"]: r for r in json.loads(lines[-1])["records"]}
    assert all(r["ops_per_token"] > 0 for r in cases.values()), cases
    model = dt.load_model(dt.trained_checkpoint())
    eos = model.hf.generation_config.eos_token_id
    with OpCounter() as ops:
        run = bench.run_single(model, [heldout_prompt(64, 0)], 6, eos, "mtp", 1, 3, 4, "fixed")
    assert cases["chain MTP N=4"]["ops_per_token"] == ops.total / len(run.tokens[0])


def test_bench_accept_dspark_trees_small_run_matches_hf_and_counts_the_mechanism(capsys):
    bench = _bench_accept()
    bench.main(["--dspark-trees", "--prompts", "1", "--prompt-len", "64", "--new-tokens", "12", "--budgets", "6",
                "--repeats", "1"])
    text = capsys.readouterr().out.strip().splitlines()
    out = json.loads(text[-1])
    cases = {r["case"]: r for r in out["records"]}
    assert {"chain DSpark N=6", "tree DSpark N=6 topk 2", "DDTree-style N=6 topk 4", "tree MTP N=6 topk 4",
            "DSpark size policy, N<=6 topk 4"} <= set(cases)
    assert all(r["output_equals_hf"] for r in out["records"]), out["records"]
    tree = cases["tree DSpark N=6 topk 2"]
    assert set(tree["nodes_per_round"]) == {"6"}  # fixed size: every round drafts all 6 nodes
    assert tree["mechanism"]["mismatches"] > 0 and "mechanism" not in cases["DSpark size policy, N<=6 topk 4"]
    assert any(line.startswith("mechanism, tree DSpark N=6 topk 2:") for line in text)
    assert max(int(n) for n in cases["DSpark size policy, N<=6 topk 4"]["nodes_per_round"]) <= 6


def test_bench_accept_only_runs_the_cases_named(capsys):
    bench = _bench_accept()
    bench.main(["--dspark-trees", "--only", "size policy,chain DSpark", "--prompts", "1", "--prompt-len", "64",
                "--new-tokens", "6", "--budgets", "6", "--repeats", "1"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["case"] for r in out["records"]] == ["HF generate (its own cache)", "chain DSpark N=6",
                                                   "DSpark size policy, N<=6 topk 4"]
    with pytest.raises(SystemExit):
        bench.main(["--only", "no such case", "--repeats", "1"])


def test_bench_accept_mechanism_counts_siblings_and_continuations():
    import dsv4_tree as dt

    bench = _bench_accept()
    # root 9 at position 3; spine 1 -> 2; sibling 5 (under the root) with child 6 -> 7
    tree = dt.DraftTree(torch.tensor([9, 1, 5, 2, 6, 7]), torch.tensor([-1, 0, 0, 1, 2, 4]))
    prompt = [0, 0, 0]
    hit = bench.mechanism([[(3, tree)]], [prompt], [[9, 5, 6, 8]])  # sibling right, +1 right, +2 wrong
    assert (hit["mismatches"], hit["sibling_hits"], hit["plus1_hits"], hit["plus2_tries"], hit["plus2_hits"]) == (1, 1, 1, 1, 0)
    spine = bench.mechanism([[(3, tree)]], [prompt], [[9, 1, 2, 4]])  # the spine right to its leaf: no mismatch
    assert spine["mismatches"] == 0 and spine["sibling_hit_rate"] is None
    miss = bench.mechanism([[(3, tree)]], [prompt], [[9, 1, 3]])  # wrong at depth 2, no sibling there
    assert (miss["mismatches"], miss["sibling_hits"]) == (1, 0)


def test_bench_budget_small_run_checks_greedy_and_reports_nodes_and_targets(capsys, tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_budget", ROOT / "benchmarks" / "bench_budget.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--bs", "1,2", "--reps", "1", "--new-tokens", "4", "--prompt-len", "48", "--tree-nodes", "8",
                       "--corpora", "project", "--profile-rounds", "1", "--plot", str(tmp_path / "b.png")]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["greedy_equal_hf"] and not out["mismatches"]
    labels = {"dspark chain fixed", "dspark chain adaptive", "dspark tree budgeted", "dspark tree 6 nodes",
              "mtp chain", "mtp tree"}
    assert {(r["case"], r["accept"], r["bs"]) for r in out["records"]} == {
        (c, a, b) for c in labels for a in ("greedy", "sampling") for b in (1, 2)}
    for r in out["records"]:
        assert r["request_rounds"] == sum(r["round_nodes_histogram"].values())
        top = {"dspark chain fixed": 6, "dspark chain adaptive": 6, "mtp chain": 4, "mtp tree": 8}.get(r["case"], 8)
        assert 1 <= r["mean_nodes_per_round"] <= top, r
    assert {(t["accept"], t["bs"]) for t in out["targets"]} == {(a, b) for a in ("greedy", "sampling") for b in (1, 2)}
    assert set(out["cost_tables"]) == {"1", "4"}  # the adaptive chain's and the budgeted tree's, profiled
