"""Every `python -m sglang.launch_server` command in README.md and docs/ (the main suite's
tests/test_docs.py leaves them here) is parsed by SGLang 0.5.23's own command-line parser and
resolved with the plug-in loaded, as its launcher would, on this CPU: so a documented flag that
SGLang does not know, a value SGLang rejects, or a configuration the plug-in refuses fails here.
Two things are substituted and only these: `--model-path` names a local tiny DeepSeek-V4 config
(no download; same model_type and layer kinds; for DSPARK one that bundles its DSpark draft, as
DeepSeek's V4 checkpoints do) and `--device cuda` is made explicit (what the
launch would run on; argument resolution reads no GPU, and SGLang refuses DSpark on any other)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from doc_blocks import all_blocks, shell_commands
from plugin_probe import dspark_dir, dsv4_dir

HERE = Path(__file__).resolve().parent
LAUNCH = ["python", "-m", "sglang.launch_server"]


def documented_launches() -> list:
    found = []
    for block in all_blocks("bash"):
        for words, env in shell_commands(block):
            if words[:3] == LAUNCH:
                found.append((block.where, words[3:], env))
    return found


def local(argv: list, root: str) -> list:
    out = list(argv)
    i = out.index("--model-path")
    dspark = "--speculative-algorithm" in out and out[out.index("--speculative-algorithm") + 1] == "DSPARK"
    out[i + 1] = dspark_dir(root) if dspark else dsv4_dir(root)
    return out + ["--device", "cuda"]


def test_documented_launches_resolve(tmp_path):
    launches = documented_launches()
    assert launches, "README.md and docs/ show no SGLang launch command"
    for where, argv, env in launches:
        assert env.get("SGLANG_PLUGINS") == "dsv4_tree", f"{where}: launch without the plug-in"
        assert "--model-path" in argv, where
    env = dict(os.environ, SGLANG_PLUGINS="dsv4_tree", TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, str(HERE / "doc_launch_probe.py"),
                          json.dumps([[e, local(a, str(tmp_path / str(i)))] for i, (_, a, e) in enumerate(launches)])],
                         cwd=HERE, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    for (where, argv, _), res in zip(launches, report, strict=True):
        assert res["ok"], f"{where}: {' '.join(argv)}\n{res['error']}"
        r = res["resolved"]
        flag = {a: argv[i + 1] for i, a in enumerate(argv[:-1]) if a.startswith("--")}
        # what the command asks for is what SGLang resolved, the plug-in keeping topk > 1
        assert str(r["speculative_eagle_topk"]) == flag.get("--speculative-eagle-topk", str(r["speculative_eagle_topk"]))
        assert str(r["speculative_num_draft_tokens"]) == flag.get("--speculative-num-draft-tokens",
                                                                  str(r["speculative_num_draft_tokens"]))
        assert str(r["tp_size"]) == flag.get("--tp", str(r["tp_size"]))


def test_a_bad_documented_flag_would_fail(tmp_path):
    """The probe reports SGLang's refusal of a flag it does not know, so a typo in the docs
    cannot pass."""
    model = dsv4_dir(str(tmp_path))
    argv = ["--model-path", model, "--speculative-algorithm", "EAGLE", "--speculative-eagle-topk", "4",
            "--speculative-num-stepz", "3", "--device", "cpu"]
    env = dict(os.environ, SGLANG_PLUGINS="dsv4_tree", TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, str(HERE / "doc_launch_probe.py"), json.dumps([[{}, argv]])], cwd=HERE, env=env,
                         capture_output=True, text=True, timeout=600)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert not report[0]["ok"] and "SystemExit" in report[0]["error"], report
