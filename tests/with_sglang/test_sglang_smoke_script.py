"""scripts/sglang_smoke.py without a GPU: its argument checks, the three launches it builds (topk 1
and topk K with CUDA graphs, topk K eager: same arguments but topk, draft-token count and
--disable-cuda-graph), that SGLang's own server-argument resolution with the plug-in loaded (so
the plug-in's validator) accepts all in its --dry-run and refuses a configuration outside the
validator, and its output comparison."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from plugin_probe import dspark_dir, dsv4_dir

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "sglang_smoke.py"
SPECULATIVE = {"speculative_eagle_topk", "speculative_num_draft_tokens"}


def smoke_module():
    spec = importlib.util.spec_from_file_location("sglang_smoke", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def dry_run(model: str, *extra: str):
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop("SGLANG_PLUGINS", None)
    out = subprocess.run([sys.executable, str(SCRIPT), model, "--dry-run", "--device", "cpu", *extra], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=600)
    return out.returncode, json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return dsv4_dir(str(tmp_path_factory.mktemp("smoke")))


def test_dry_run_launches_pass_sglang_resolution(model):
    rc, report, err = dry_run(model, "--tp", "1", "--topk", "4", "--num-steps", "3", "--num-draft-tokens", "8")
    assert rc == 0, err[-3000:]
    chain, tree, eager = report["launches"]
    ck, tk, ek = chain["engine_kwargs"], tree["engine_kwargs"], eager["engine_kwargs"]
    assert (ck["speculative_eagle_topk"], ck["speculative_num_draft_tokens"]) == (1, 4)
    assert (tk["speculative_eagle_topk"], tk["speculative_num_draft_tokens"]) == (4, 8)
    assert ek == dict(tk, disable_cuda_graph=True)
    same = {k: v for k, v in ck.items() if k not in SPECULATIVE}
    assert same == {k: v for k, v in tk.items() if k not in SPECULATIVE}
    assert (same["disable_cuda_graph"], same["dsv4_attn_backend"], same["model_path"]) == (False, "flashmla", model)
    for launch, topk, n, eager_only in ((chain, 1, 4, False), (tree, 4, 8, False), (eager, 4, 8, True)):
        assert launch["ok"], launch
        r = launch["resolved"]
        assert (r["speculative_eagle_topk"], r["speculative_num_draft_tokens"], r["page_size"]) == (topk, n, 256)
        assert (r["attention_backend"], r["dsv4_attn_backend"]) == ("dsv4", "flashmla")
        assert r["disable_cuda_graph"] is eager_only, launch
        assert launch["env"] == {"SGLANG_PLUGINS": "dsv4_tree"}
        cmd = launch["command"]
        assert cmd[1] == str(SCRIPT) and cmd[2] == model and cmd[3] == "--child"
        child = json.loads(cmd[4])
        assert child["engine_kwargs"] == launch["engine_kwargs"]
        assert child["sampling_params"] == {"temperature": 0.0, "max_new_tokens": 200}  # greedy


@pytest.fixture(scope="module")
def dspark_model(tmp_path_factory):
    return dspark_dir(str(tmp_path_factory.mktemp("smoke_dspark")))


@pytest.mark.parametrize("n", [8, 16])  # 16: past SGLang's C4 ring bound of 10 (the plug-in sizes the ring)
def test_dspark_dry_run_launches_pass_sglang_resolution(dspark_model, n):
    """--algorithm DSPARK: SGLang's DSpark chain (topk 1, N = gamma + 1 = 6), then the DSpark tree
    (topk 4, N 8 or 16) graphed and eager, with the environment the tree step needs. DSPARK resolution
    needs an accelerator's device name (SGLang refuses "cpu"); nothing is allocated."""
    rc, report, err = dry_run(dspark_model, "--algorithm", "DSPARK", "--topk", "4", "--num-draft-tokens", str(n),
                              "--device", "cuda")
    assert rc == 0, err[-3000:]
    chain, tree, eager = report["launches"]
    ck, tk, ek = chain["engine_kwargs"], tree["engine_kwargs"], eager["engine_kwargs"]
    assert ck["speculative_algorithm"] == tk["speculative_algorithm"] == "DSPARK"
    assert ck["speculative_eagle_topk"] == 1 and "speculative_num_draft_tokens" not in ck
    assert (tk["speculative_eagle_topk"], tk["speculative_num_draft_tokens"]) == (4, n) and "grammar_backend" not in tk
    assert ek == dict(tk, disable_cuda_graph=True)
    assert chain["env"] == {"SGLANG_PLUGINS": "dsv4_tree"}
    assert tree["env"] == eager["env"] == {"SGLANG_PLUGINS": "dsv4_tree", "SGLANG_DSPARK_FOLDED_PROPOSAL": "0"}
    for launch, topk, want_n, eager_only in ((chain, 1, 6, False), (tree, 4, n, False), (eager, 4, n, True)):
        assert launch["ok"], launch
        r = launch["resolved"]
        assert (r["speculative_algorithm"], r["speculative_eagle_topk"], r["speculative_num_draft_tokens"],
                r["speculative_num_steps"], r["disable_cuda_graph"]) == ("DSPARK", topk, want_n, 1, eager_only), r
        # the tree's gamma, declared by the plug-in's argument hook (SGLang's chain leaves the flag unset)
        assert r["speculative_dspark_block_size"] == (None if topk == 1 else 5) and r["dsv4_attn_backend"] == "flashmla"
    assert "[dry-run] DSPARK topk 4, CUDA graphs (dsv4_tree tree path): accepted" in err


def test_dry_run_refuses_what_the_validator_refuses(model):
    rc, report, _ = dry_run(model, "--num-draft-tokens", "65")  # past the validator's bound of 64
    chain, *trees = report["launches"]
    assert rc == 2 and chain["ok"] and len(trees) == 2
    for tree in trees:
        assert not tree["ok"]
        assert tree["error"].startswith("ConfigError") and "--speculative-num-draft-tokens" in tree["error"]


def test_arguments_are_checked(tmp_path, capsys):
    mod = smoke_module()
    (tmp_path / "config.json").write_text("{}")
    a = mod.parse_args([str(tmp_path)])
    assert (a.tp, a.topk, a.num_steps, a.num_draft_tokens, a.dry_run, a.algorithm) == (1, 4, 3, 8, False, "EAGLE")
    assert mod.parse_args([str(tmp_path), "--algorithm", "DSPARK"]).algorithm == "DSPARK"
    for bad, named in ((["--topk", "1"], "--topk must be > 1"), (["--num-steps", "0"], "--num-steps"),
                       (["--algorithm", "NGRAM"], "invalid choice: 'NGRAM'"),
                       (["--max-new-tokens", "0"], "--max-new-tokens")):
        with pytest.raises(SystemExit) as exc:
            mod.parse_args([str(tmp_path), *bad])
        assert exc.value.code == 2 and named in capsys.readouterr().err
    with pytest.raises(SystemExit):
        mod.parse_args([str(tmp_path / "missing")])
    assert "has no config.json" in capsys.readouterr().err


def test_compare_reports_the_first_difference(capsys):
    mod = smoke_module()
    assert mod.compare({"output_ids": [1, 2, 3], "text": "a"}, {"output_ids": [1, 2, 3], "text": "a"}) == 0
    assert "identical (3 tokens)" in capsys.readouterr().out
    assert mod.compare({"output_ids": [1, 2, 3], "text": "a"}, {"output_ids": [1, 5, 3], "text": "b"}) == 1
    assert "differ at token 1" in capsys.readouterr().err
    assert mod.compare({"output_ids": [1, 2], "text": "a"}, {"output_ids": [1, 2, 3], "text": "b"}) == 1
    assert "differ at token 2" in capsys.readouterr().err
    assert mod.compare({"output_ids": [], "text": ""}, {"output_ids": [], "text": ""}) == 2  # a failed request
    assert "no tokens generated" in capsys.readouterr().err


def test_compare_tells_a_near_tie_from_a_real_difference(capsys):
    """At the first differing token the topk 1 run's top-2 log-probabilities decide: within
    NEAR_TIE nats -> 3 (bf16 rounding of other kernel shapes can swap them), else 1."""
    mod = smoke_module()
    top2 = lambda gap: [[[-0.1, 1], [-2.0, 9]], [[-0.5, 2], [-0.5 - gap, 5]], [[-0.1, 3], [-3.0, 4]]]  # noqa: E731
    near = {"output_ids": [1, 2, 3], "text": "a", "top2": top2(0.5 * mod.NEAR_TIE)}
    far = {"output_ids": [1, 2, 3], "text": "a", "top2": top2(4 * mod.NEAR_TIE)}
    other = {"output_ids": [1, 5, 3], "text": "b"}
    assert mod.compare(near, other) == 3 and "NEAR TIE" in capsys.readouterr().err
    assert mod.compare(far, other) == 1 and "not a near tie" in capsys.readouterr().err
    assert mod.top2_margin(far, 1) == pytest.approx(4 * mod.NEAR_TIE) and mod.top2_margin(far, 7) is None


def test_compare_all_runs_against_the_baseline(capsys):
    mod = smoke_module()
    run = lambda ids: {"output_ids": ids, "text": ""}  # noqa: E731
    names = ["graphs topk 1", "graphs topk 4", "eager topk 4"]
    assert mod.compare_all([run([1, 2]), run([1, 2]), run([1, 2])], names) == 0
    assert mod.compare_all([run([1, 2]), run([1, 2]), run([1, 3])], names) == 1  # the eager tree run differs
    assert "eager topk 4 against graphs topk 1" in capsys.readouterr().out
    assert mod.compare_all([run([1, 2]), run([]), run([1, 3])], names) == 2
