"""The ahead-of-time sm_90a (H200) gate (dsv4_tree/aot, design_notes/aot-gate.md), on a CPU.

The normal suite runs the tiny and V4-Flash N = 8 verify scenarios and the negative controls,
compiling every recorded specialisation with Triton's compiler and the ptxas / cuobjdump of the
triton wheel, under this environment's Triton (3.9.0; the V4-Flash scenario also under SGLang's
3.8.0, in .venv-triton3.8.0: scripts/triton_env.sh); `slow` runs every V4-Flash / V4-Pro scenario under
every Triton a supported CUDA torch brings (design_notes/triton-versions.md), with a result
cache keyed by kernel source and Triton version ($DSV4_TREE_AOT_CACHE, default
~/.cache/dsv4-tree/aot)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsv4_tree.aot import checks
from dsv4_tree.aot.compiler import CompileResult
from dsv4_tree.aot.controls import CONTROLS
from dsv4_tree.aot.scenarios import FULL, QUICK

pytestmark = pytest.mark.skipif(os.environ.get("DSV4_TREE_GPU") == "1", reason="records under the interpreter")
ROOT = Path(__file__).resolve().parents[1]
SGLANG_TRITON = "3.8.0"  # what SGLang 0.5.23's torch 2.14.1 brings (tests/with_sglang/test_sglang_env.py)


def _fail_text(report) -> str:
    return report.text() + "\n" + "\n".join(_flagged({"rows": report.rows}))


@pytest.fixture(scope="module")
def quick_report():
    from dsv4_tree.aot.gate import run_gate

    return run_gate(QUICK, cache_dir=None)


def test_quick_gate_every_spec_launches_without_spills(quick_report):
    rep = quick_report
    assert len(rep.rows) >= 40, "the tiny and V4-Flash verify scenarios record every kernel's launches"
    assert rep.flagged == 0, _fail_text(rep)


def test_quick_gate_attention_and_indexer_use_tensor_cores_at_v4_dims(quick_report):
    flash = [r for r in quick_report.rows if r["where"] == "flash-verify" and r["kernel"] in checks.MMA_KERNELS]
    assert {r["kernel"] for r in flash} == {"_sparse_decode_kernel", "_indexer_topk_kernel"}
    assert all(r["mma"] > 0 and "MMA=True" in r["spec"] for r in flash), flash


def test_quick_gate_controls_fire(quick_report):
    assert [(n, f) for n, f, _ in quick_report.controls] == [(s.name, f) for s, f in CONTROLS]
    assert all(fired for _, _, fired in quick_report.controls), quick_report.controls


def _result(name="_sparse_decode_kernel", mma_constexpr=True, **data):
    from dsv4_tree.aot.spec import KernelSpec

    spec = KernelSpec(f"m:{name}", (("x", "*fp32"), ("MMA", "constexpr")), (((1,), mma_constexpr),), (), ())
    return CompileResult(spec, data.pop("status", "ok"), data.pop("seconds", 1.0), data)


def test_each_limit_flags_its_own_breach():
    assert checks.flags(_result(mma=4, shared=1000, static_shared=1024)) == []
    assert checks.flags(_result(mma=4, shared=227 * 1024, static_shared=1024)) == ["SMEM>227K"]
    assert checks.flags(_result(status="smem", shared=300_000)) == ["SMEM>227K"]
    assert checks.flags(_result(mma=4, stack=8)) == ["SPILL"]
    assert checks.flags(_result(mma=4, spill_stores=4)) == ["SPILL"]
    assert checks.flags(_result(mma=4, local=4)) == ["SPILL"]
    assert checks.flags(_result(mma=4, seconds=121.0)) == ["TIME>120s"]
    assert checks.flags(_result(mma=0)) == ["NO-MMA"]
    # the fp32 form of the tiny (fp32) model needs no tensor cores; at V4 dims it would
    assert checks.flags(_result(mma_constexpr=False, mma=0), "tiny") == []
    assert checks.flags(_result(mma_constexpr=False, mma=0), "tiny-prefill") == []
    assert checks.flags(_result(mma_constexpr=False, mma=0), "flash-verify") == ["NO-MMA"]
    assert checks.flags(_result("_hc_pre_kernel", mma=0), "flash-verify") == []
    assert checks.flags(_result(status="error", error="CompilationError")) == ["FAIL(error)"]


def gate_under(version: str, scenarios, cache=None) -> dict:
    """`python -m dsv4_tree.aot` in this environment with only Triton replaced (<venv>-triton<version>,
    built by scripts/triton_env.sh when missing): the library's launches recorded and compiled
    under that Triton. Its --json report."""
    import torch

    venv = Path(sys.prefix + f"-triton{version}")
    python = venv / "bin" / "python"
    if not python.exists() or subprocess.run([str(python), "-c", "import triton, dsv4_tree"]).returncode:
        env = dict(os.environ, DSV4_TREE_TORCH=torch.__version__.split("+")[0], DSV4_TREE_VENV=sys.prefix)
        subprocess.run(["bash", str(ROOT / "scripts" / "triton_env.sh"), version], check=True, cwd=ROOT,
                       stdout=sys.stderr, env=env)
    out = venv / f"gate-{os.getpid()}.json"
    cmd = [str(python), "-m", "dsv4_tree.aot", "--scenarios", ",".join(scenarios), "--json", str(out)]
    if cache:
        cmd += ["--cache", str(cache)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    assert out.exists(), f"the gate under Triton {version} did not report:\n{run.stderr[-3000:]}"
    report = json.loads(out.read_text())
    out.unlink()
    assert report["triton"] == version, report["triton"]
    return report


def _flagged(report):
    """One line per flagged specialisation of a gate report (the controls left out)."""
    return [f"{r['kernel']} [{r['where']}] {r['spec']}: {r['flags']} {r.get('error') or ''}"[:600]
            for r in report["rows"] if r["flags"] and r["where"] != "control"]


def test_quick_gate_under_sglangs_triton():
    """The plug-in's kernels run under SGLang's Triton: the tiny (fp32) and V4-Flash N = 8
    launches recorded and compiled under 3.8.0, clean; the controls fire."""
    rep = gate_under(SGLANG_TRITON, QUICK)
    assert {r["where"] for r in rep["rows"]} >= set(QUICK) and len(rep["rows"]) >= 40
    assert _flagged(rep) == [] and rep["ok"], rep["verdict"]
    assert all(fired for _, _, fired in rep["controls"]), rep["controls"]


def _aot_cache() -> Path:
    return Path(os.environ.get("DSV4_TREE_AOT_CACHE", Path.home() / ".cache" / "dsv4-tree" / "aot"))


@pytest.mark.slow
@pytest.mark.parametrize("version", ["3.6.0", "3.7.1", "3.8.0"])
def test_full_gate_under_each_cuda_torchs_triton(version):
    """Every scenario under the Triton of torch 2.11 (3.6.0), 2.13 (3.7.1) and 2.14 (3.8.0): clean."""
    rep = gate_under(version, FULL, cache=_aot_cache())
    assert len(rep["rows"]) >= 80, "every scenario's launches recorded"
    assert _flagged(rep) == [] and rep["ok"], "\n".join(_flagged(rep))
    assert all(fired for _, _, fired in rep["controls"]), rep["controls"]


@pytest.mark.slow
def test_the_derived_launch_set_compiles_clean():
    """Every specialisation of the launch rules' scenarios (launch_rules.py: both pools, bucketed
    verify at every batch bucket and N, prefill chunks and tails, at tiny, V4-Flash and V4-Pro
    dims), which tests/test_aot_coverage.py holds the public paths to, compiles clean under this
    environment's Triton."""
    from dsv4_tree.aot.gate import run_gate
    from dsv4_tree.aot.scenarios import RULES

    rep = run_gate(RULES, cache_dir=_aot_cache(), with_controls=False)
    assert len(rep.rows) >= 80, "every rules scenario's launches recorded"
    assert rep.flagged == 0, _fail_text(rep)


@pytest.mark.slow
def test_full_gate_every_v4_flash_and_pro_specialisation():
    from dsv4_tree.aot.gate import run_gate

    rep = run_gate(FULL, cache_dir=_aot_cache())
    assert len(rep.rows) >= 80, "every scenario's launches recorded"
    assert rep.ok, _fail_text(rep)
