"""fp32 kernels run their dots in full precision: Triton's default on NVIDIA GPUs is TF32
(inputs rounded to a 10-bit mantissa), which the CPU interpreter does not model.

On CPU the `tf32_hardware` fixture makes the interpreter behave like an NVIDIA GPU: every
tl.dot whose input_precision is not "ieee" gets its fp32 inputs rounded to TF32 first. On a
GPU (DSV4_TREE_GPU=1) the hardware does that itself. Either way the fp32 kernels must still
match the fp32 references at the kernel-test tolerance."""
import ast
from pathlib import Path

import numpy as np
import pytest
import torch

import dsv4_tree as dt
from cases import check_against_oracle, prompt, random_tree, small_model
from dsv4_tree import kernels
from dsv4_tree.reference import ops as ref
from test_kernels import TOL, attention_case

KERNELS = Path(__file__).resolve().parents[1] / "kernels"


def _round_to_tf32(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even of fp32 values to TF32's 10 mantissa bits (inf/nan kept)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    special = (bits & np.uint32(0x7F800000)) == np.uint32(0x7F800000)
    rounded = (bits + ((bits >> np.uint32(13)) & np.uint32(1)) + np.uint32(0xFFF)) & np.uint32(0xFFFFE000)
    return np.where(special, bits, rounded).view(np.float32)


@pytest.fixture
def tf32_hardware(device, monkeypatch):
    """Dots behave as on an NVIDIA GPU. Yields how many fp32 dots ran in IEEE precision."""
    seen = {"ieee": 0, "other": 0}
    if device.type == "cuda":  # the real thing
        yield seen
        return
    from triton._C.libtriton import ir
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.data.dtype == np.float32 and b.data.dtype == np.float32:
            if input_precision == ir.INPUT_PRECISION.IEEE:
                seen["ieee"] += 1
            else:
                seen["other"] += 1
                a = interpreter.TensorHandle(_round_to_tf32(a.data), a.dtype)
                b = interpreter.TensorHandle(_round_to_tf32(b.data), b.dtype)
        return original(self, a, b, d, input_precision, max_num_imprecise_acc)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)
    yield seen


def test_emulation_rounds_like_tf32():
    x = np.array([1.0 + 2.0 ** -11, 1.0 + 2.0 ** -10 + 2.0 ** -12, -3.0, np.inf], dtype=np.float32)
    assert _round_to_tf32(x).tolist() == [1.0, 1.0 + 2.0 ** -10, -3.0, np.inf]


def test_fp32_attention_and_indexer_kernels_are_exact_on_tf32_hardware(tf32_hardware, device):
    args = attention_case(7, 16, 64, 40, 30, 17, 64, 20, seed=11, device=device)
    want_out, want_lse = ref.ref_sparse_mqa_sink(*args)
    got_out, got_lse = kernels.sparse_mqa_sink(*args)
    err = (got_out - want_out).abs().max().item()
    assert torch.allclose(got_out, want_out, **TOL), f"attention max abs error {err:.2e}"
    assert torch.allclose(got_lse, want_lse, **TOL)
    gen = torch.Generator().manual_seed(5)
    q, w, keys = torch.randn(6, 8, 32, generator=gen), torch.randn(6, 8, generator=gen), torch.randn(40, 32, generator=gen)
    got = kernels.indexer_scores(q.to(device), w.to(device), keys.to(device), 32 ** -0.5).cpu()
    assert torch.allclose(got, ref.indexer_scores(q, w, keys, 32 ** -0.5), **TOL)
    if device.type == "cpu":
        assert tf32_hardware["ieee"] > 0 and tf32_hardware["other"] == 0, tf32_hardware


def test_whole_model_triton_backend_exact_on_tf32_hardware(tf32_hardware, device):
    model = small_model(device=device.type)
    eng = dt.Engine(model, dt.SpecConfig(eagle_topk=4, num_steps=6, num_draft_tokens=12, attention_backend="triton"))
    p = prompt(17, 6)
    check_against_oracle(model, eng, [p], [random_tree(int(p[-1]), 12, 5, 3, 6)], "triton on TF32 hardware")


def test_every_kernel_dot_states_ieee_precision():
    """Static guard: a new tl.dot without input_precision="ieee" would silently run in TF32."""
    dots = 0
    for path in sorted(KERNELS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "dot":
                dots += 1
                prec = {k.arg: k.value for k in node.keywords}.get("input_precision")
                assert isinstance(prec, ast.Constant) and prec.value == "ieee", f"{path.name}:{node.lineno}"
    assert dots >= 4


def test_bf16_inputs_cost_one_output_rounding(device):
    """bf16 inputs: tiles are upcast exactly and summed in fp32 (ieee), so the only error
    against the fp32 reference on the same bf16 values is rounding the output to bf16: at most
    one bf16 unit roundoff, |got - want| <= 2^-8 |want| (+1e-5 for fp32 summation order);
    measured 3.8e-3 = 0.97 x 2^-8 worst. lse and indexer scores are fp32 outputs: fp32 tolerance."""
    for case in [(3, 4, 32, 0, 20, 9, 0, 0), (4, 8, 16, 0, 10, 8, 50, 5), (7, 16, 64, 40, 30, 17, 64, 20)]:
        args = attention_case(*case, seed=sum(case), device=device)
        bf = [a.to(torch.bfloat16) if torch.is_tensor(a) and a.is_floating_point() else a for a in args]
        want, want_lse = ref.ref_sparse_mqa_sink(*[a.float() if torch.is_tensor(a) and a.is_floating_point() else a
                                                   for a in bf])
        got, got_lse = kernels.sparse_mqa_sink(*bf)
        assert got.dtype == torch.bfloat16
        excess = ((got.float() - want).abs() - (2 ** -8 * want.abs() + 1e-5)).max()
        assert excess <= 0, f"{case=}: error exceeds one bf16 rounding by {excess:.2e}"
        assert torch.allclose(got_lse, want_lse, **TOL), f"{case=}"
    gen = torch.Generator().manual_seed(8)
    q, w, keys = torch.randn(6, 8, 32, generator=gen).bfloat16(), torch.randn(6, 8, generator=gen), \
        torch.randn(300, 32, generator=gen).bfloat16()
    got = kernels.indexer_scores(q.to(device), w.to(device), keys.to(device), 32 ** -0.5).cpu()
    assert torch.allclose(got, ref.indexer_scores(q.float(), w, keys.float(), 32 ** -0.5), **TOL)
