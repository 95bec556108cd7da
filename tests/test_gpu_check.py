"""scripts/gpu_check --dry-run: the whole GPU check, end to end on CPU at tiny shapes.

Covers every step the GPU run has, through the same wrapper and the same report writer, started
as from a shell (no TRITON_INTERPRET, no DSV4_TREE_GPU): the gpu-marked tests (collected,
skipped without CUDA; the device-fixture tests the GPU run adds are this suite's own on the
CPU), bench_verify (one 4K context instead of 64K/256K/1M, fp32), the Triton bench_verify
(tiny shapes, through the interpreter), bench_batch (bs 1 and 2, N = 4, both models), and the
CUDA-graph step (run where SpecConfig has cuda_graph_max_bs, otherwise reported as not
available). What it cannot cover: anything that needs CUDA (bf16 kernels, graph capture, GPU
timings)."""
import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


# slow (nightly, docs/testing.md): the GPU script rehearsed end to end through the interpreter; its wrapper, report
# and step selection are tested below, each benchmark it runs in tests/test_benchmarks.py
@pytest.mark.slow
def test_gpu_check_dry_run_writes_the_report(tmp_path):
    # as from a shell: not the TRITON_INTERPRET=1 this suite's conftest sets for itself
    env = {k: v for k, v in os.environ.items() if k not in ("DSV4_TREE_GPU", "TRITON_INTERPRET")}
    # the step limits bound a GPU run; here they only stop a hung step (a loaded CPU is slow, not wrong)
    limits = ["--budget-s", "1200", "--limit-tests", "600", "--limit-verify", "600", "--limit-batch", "600",
              "--limit-graph", "600"]
    proc = subprocess.run(["bash", "scripts/gpu_check", "--out", str(tmp_path), "--dry-run", *limits],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    report = json.loads((tmp_path / "report.json").read_text())
    steps = {s["name"]: s for s in report["steps"]}
    bad = {n: (s["status"], s["summary"], s["tail"]) for n, s in steps.items() if s["status"] not in ("ok", "not available")}
    assert proc.returncode == 0 and not bad, f"rc={proc.returncode} {bad}\n{proc.stderr[-2000:]}"
    assert report["mode"] == "dry-run"
    assert list(steps) == ["gpu_tests", "aot_launch", "bench_verify_4K", "bench_verify_triton", "bench_batch",
                           "cuda_graph_eager", "cuda_graph_replay", "draft_graph", "aot_gate"]
    assert steps["aot_launch"]["status"] == "not available"  # no GPU: nothing to launch on
    gate = steps["aot_gate"]["result"]
    assert gate["ok"] and set(gate["kernels"]) >= {"_sparse_decode_kernel", "_indexer_topk_kernel"}, gate
    assert "## aot_gate" in (tmp_path / "report.md").read_text()
    assert steps["bench_verify_triton"]["result"]["backend"] == "triton"
    assert "skipped" in steps["gpu_tests"]["summary"], steps["gpu_tests"]  # no CUDA here: collected, skipped
    assert steps["bench_verify_triton"]["env"] == {"TRITON_INTERPRET": "1"}  # set by the dry run itself
    verify = steps["bench_verify_4K"]["result"]
    assert [(r["context"], r["N"]) for r in verify["records"]] == [(4096, 4)]
    batch = steps["bench_batch"]["result"]
    assert {(r["model"], r["bs"]) for r in batch["records"]} == {("trained", 1), ("trained", 2), ("flash", 1)}
    assert all(r["ops"] > 0 and r["verify_ms"] > 0 and r["plan_ms"] > 0 for r in batch["records"])
    assert batch["plan_timer"] in ("engine.plan", "build_plan")
    draft = steps["draft_graph"]["result"]  # the eager stand-in on CPU: same tokens, every case and bs
    cases = ("dspark chain", "dspark tree (topk 4, 8 nodes)", "dspark tree budgeted (<= 16 nodes)",
             "mtp tree (topk 4, 8 nodes)")
    assert {(r["case"], r["bs"]) for r in draft["ratios"]} == {(c, b) for c in cases for b in (1, 2)}
    assert all(r["same_tokens"] for r in draft["ratios"]), draft["ratios"]
    graph = steps["cuda_graph_replay"]
    assert (graph["status"] == "not available") == (not report["cuda_graph"]), graph
    md = (tmp_path / "report.md").read_text()
    assert "| bench_batch | ok |" in md and "## bench_verify_4K" in md and "| trained | 4 | 2 |" in md
    assert (tmp_path / "bench_batch.png").exists() and (tmp_path / "logs" / "bench_batch.log").exists()


def _gpu_check_module():
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_steps_record_ok_failure_timeout_and_budget(tmp_path):
    """The step runner on its own (fast): every outcome lands in the report as what it was."""
    import sys
    import time

    gc = _gpu_check_module()
    py = sys.executable
    far = time.monotonic() + 60
    ok = gc.Step("bench_x", [py, "-c", "print('table'); print('{\"records\": []}')"], 30)
    bad = gc.Step("bench_y", [py, "-c", "import sys; print('boom'); sys.exit(3)"], 30)
    no_json = gc.Step("bench_z", [py, "-c", "print('no json')"], 30)
    slow = gc.Step("bench_s", [py, "-c", "import time; time.sleep(30)"], 6)
    late = gc.Step("bench_l", [py, "-c", "print(1)"], 30)
    for step in (ok, bad, no_json, slow):
        gc.run(step, far, tmp_path)
    gc.run(late, time.monotonic() + 1, tmp_path)  # less than 5 s of budget left
    assert (ok.status, ok.result) == ("ok", {"records": []})
    assert (bad.status, bad.summary) == ("failed", "exit code 3") and "boom" in bad.tail
    assert no_json.status == "failed" and "JSON" in no_json.summary
    assert slow.status == "timeout" and 5 < slow.seconds < 20
    assert late.status == "skipped" and "budget" in late.summary
    assert "boom" in (tmp_path / "bench_y.log").read_text()


def test_cuda_graph_ratios_and_report_table():
    gc = _gpu_check_module()

    def batch(ms):
        return {"records": [{"bs": bs, "verify_ms_per_request": m} for bs, m in ms.items()]}

    eager = gc.Step("cuda_graph_eager", [], 1, status="ok", result=batch({1: 2.0, 64: 1.0}))
    replay = gc.Step("cuda_graph_replay", [], 1, status="ok", result=batch({1: 0.5, 64: 0.5}))
    ratios = gc.graph_ratios([eager, replay])
    assert [(g["bs"], g["replay_over_eager"]) for g in ratios] == [(1, 0.25), (64, 0.5)]
    report = {"mode": "gpu", "machine": "m", "torch": "t", "python": "p", "started": "s", "seconds": 1.0,
              "cuda_graph": ratios}
    md = gc.markdown(report, [eager, replay])
    assert "| 64 | 1.000 | 0.500 | 0.500 |" in md and "| cuda_graph_replay | ok |" in md


def test_only_runs_the_named_steps_and_the_rest_do_not_fail_the_run(tmp_path, monkeypatch):
    gc = _gpu_check_module()
    ran = []

    def fake_run(step, budget_end, log_dir):
        ran.append(step.name)
        step.status = "ok"

    monkeypatch.setattr(gc, "run", fake_run)
    assert gc.main(["--out", str(tmp_path), "--dry-run", "--only", "bench_batch"]) == 0
    assert ran == ["bench_batch"]
    report = json.loads((tmp_path / "report.json").read_text())
    assert {s["name"]: s["status"] for s in report["steps"]}["gpu_tests"] == "not selected"


def test_only_with_an_unknown_step_name_is_refused(tmp_path, capsys):
    gc = _gpu_check_module()
    with pytest.raises(SystemExit) as exc:
        gc.main(["--out", str(tmp_path), "--dry-run", "--only", "gpu_test"])
    assert exc.value.code == 2 and "unknown steps ['gpu_test']" in capsys.readouterr().err


def _gpu_check_module():
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("_gpu_check", ROOT / "scripts" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_gpu_check_installs_what_the_install_page_says():
    """docs/install.md's command for a CUDA torch is the one `gpu_check --install` runs (with the
    checkout in place of the name)."""
    import re

    gc = _gpu_check_module()
    page = (ROOT / "docs" / "install.md").read_text()
    extras = re.findall(r'^pip install "dsv4-tree\[([\w,]+)\]"\s+# keeps your torch', page, re.M)
    assert extras == [",".join(gc.GPU_EXTRAS)], extras


def test_the_install_keeps_this_environments_torch_and_triton():
    """pip's own dry run of `gpu_check --install` here: it resolves beside this environment's
    torch and Triton without replacing either (in .venv-torch2.11.0 that is the CUDA image's
    torch 2.11.0 with Triton 3.6.0)."""
    import importlib.metadata as md
    import sys

    got = _gpu_check_module().install(sys.executable, dry_run=True)
    assert got == f"{md.version('torch')} {md.version('triton')}", got
