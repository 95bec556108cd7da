"""The ahead-of-time sm_90a (H200) gate (dsv4_tree/aot, design_notes/aot-gate.md), on a CPU.

The normal suite runs the tiny and V4-Flash N = 8 verify scenarios and the negative controls,
compiling every recorded specialisation with Triton's compiler and the ptxas / cuobjdump of the
triton wheel; `slow` runs every V4-Flash / V4-Pro scenario with a result cache keyed by kernel
source ($DSV4_TREE_AOT_CACHE, default ~/.cache/dsv4-tree/aot)."""
import os
from pathlib import Path

import pytest

from dsv4_tree.aot import checks
from dsv4_tree.aot.compiler import CompileResult
from dsv4_tree.aot.controls import CONTROLS
from dsv4_tree.aot.scenarios import FULL, QUICK

pytestmark = pytest.mark.skipif(os.environ.get("DSV4_TREE_GPU") == "1", reason="records under the interpreter")


def _fail_text(report) -> str:
    bad = [r for r in report.rows if r["flags"] and r["where"] != "control"]
    return report.text() + "\n" + "\n".join(f"{r['kernel']} [{r['where']}] {r['spec']}: {r['flags']} {r['error']}"
                                            for r in bad)


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


@pytest.mark.slow
def test_full_gate_every_v4_flash_and_pro_specialisation():
    from dsv4_tree.aot.gate import run_gate

    cache = Path(os.environ.get("DSV4_TREE_AOT_CACHE", Path.home() / ".cache" / "dsv4-tree" / "aot"))
    rep = run_gate(FULL, cache_dir=cache)
    assert len(rep.rows) >= 80, "every scenario's launches recorded"
    assert rep.ok, _fail_text(rep)
