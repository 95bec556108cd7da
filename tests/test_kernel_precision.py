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
from dsv4_tree.aot.record import LaunchRecorder
from dsv4_tree.reference.sparse_decode import ref_indexer_gather_scores, ref_sparse_decode
from dsv4_tree.serving import KVPool
from test_kernels import TOL

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


def pool_of(rows: torch.Tensor, kv_dtype: str = "auto", rope_dim: int = 0, page_size: int = 16) -> KVPool:
    """A pool (fp32 compute dtype) whose slot i holds rows[i]."""
    pool = KVPool(rows.shape[0], rows.shape[1], rope_dim, kv_dtype, page_size, rows.device, torch.float32)
    pool.write(torch.arange(rows.shape[0], device=rows.device), rows)
    return pool


def decode_case(t, h, d, m, k, g, k2, seed, device, kv_dtype="auto"):
    """sparse_decode arguments: q fp32, two pools (main m rows, extra g rows) of kv_dtype, per-row
    index lists with -1 holes; every row has at least one key (finite lse)."""
    gen = torch.Generator().manual_seed(seed)

    def table(k, size):
        i = torch.randint(0, size, (t, k), generator=gen, dtype=torch.int32)
        i[torch.rand(t, k, generator=gen) < 0.3] = -1
        i[:, 0] = torch.randint(0, size, (t,), generator=gen, dtype=torch.int32)
        return i.to(device), torch.full((t,), k, dtype=torch.int32, device=device)

    main = pool_of(torch.randn(m, d, generator=gen).to(device), kv_dtype, rope_dim=d // 4)
    extra = pool_of(torch.randn(g, d, generator=gen).to(device), kv_dtype, rope_dim=d // 4)
    (mi, ml), (xi, xl) = table(k, m), table(k2, g)
    return dict(q=torch.randn(t, h, d, generator=gen).to(device), kv=main, indices=mi, lengths=ml,
                sinks=torch.randn(h, generator=gen).to(device), scale=d ** -0.5,
                extra_kv=extra, extra_indices=xi, extra_lengths=xl)


def test_fp32_attention_and_indexer_kernels_are_exact_on_tf32_hardware(tf32_hardware, device):
    args = decode_case(7, 16, 64, 40, 17, 64, 20, seed=11, device=device)
    want_out, want_lse = ref_sparse_decode(**args)
    got_out, got_lse = kernels.sparse_decode(**args)
    err = (got_out - want_out).abs().max().item()
    assert torch.allclose(got_out, want_out, **TOL), f"attention max abs error {err:.2e}"
    assert torch.isfinite(want_lse).all() and torch.allclose(got_lse, want_lse, **TOL)
    gen = torch.Generator().manual_seed(5)
    q, w, keys = torch.randn(6, 8, 32, generator=gen), torch.randn(6, 8, generator=gen), torch.randn(40, 32, generator=gen)
    pool = pool_of(keys.to(device))
    cand = torch.randperm(40, generator=gen).to(torch.int32).expand(6, 40).contiguous().to(device)
    got = kernels.indexer_gather_scores(q.to(device), w.to(device), pool, cand, 32 ** -0.5)
    want = ref_indexer_gather_scores(q.to(device), w.to(device), pool, cand, 32 ** -0.5)
    assert torch.allclose(got, want, **TOL)
    if device.type == "cpu":
        assert tf32_hardware["ieee"] > 0 and tf32_hardware["other"] == 0, tf32_hardware


# slow (nightly, docs/testing.md): the whole model on emulated TF32 hardware; every attention and indexer kernel on
# it stays in every run (test_fp32_attention_and_indexer_kernels_are_exact_on_tf32_hardware)
@pytest.mark.slow
def test_whole_model_triton_backend_exact_on_tf32_hardware(tf32_hardware, device):
    model = small_model(device=device.type)
    eng = dt.Engine(model, dt.SpecConfig(eagle_topk=4, num_steps=6, num_draft_tokens=12, attention_backend="triton"))
    p = prompt(17, 6)
    check_against_oracle(model, eng, [p], [random_tree(int(p[-1]), 12, 5, 3, 6)], "triton on TF32 hardware")


def test_every_kernel_dot_states_ieee_precision():
    """Static guard: a new tl.dot without input_precision="ieee" would silently run in TF32. Every
    kernel dots through _dot.py; there the one tl.dot without it is `mma`'s compiled form, whose
    operands are bf16 (`to_mma`): TF32 applies to fp32 operands only."""
    dots, bf16 = 0, []
    for path in sorted(KERNELS.glob("*.py")):
        tree = ast.parse(path.read_text())
        for fn in [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]:
            for node in ast.walk(fn):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "dot":
                    dots += 1
                    prec = {k.arg: k.value for k in node.keywords}.get("input_precision")
                    if not (isinstance(prec, ast.Constant) and prec.value == "ieee"):
                        bf16.append(f"{path.name}:{fn.name}")
    assert dots >= 3 and bf16 == ["_dot.py:mma"], bf16  # dot_fp32, mma's two forms


def test_bf16_inputs_cost_one_output_rounding(device):
    """bf16 queries and a bf16 pool: tiles are upcast exactly and summed in fp32 (ieee), so the
    only error against the fp32 reference on the same bf16 values is the kernel's one cast of the
    output to bf16 (+1e-5 for fp32 summation order). On a GPU that cast rounds to nearest:
    at most one bf16 unit roundoff, |got - want| <= 2^-8 |want|. Triton 3.9's interpreter
    truncates the same cast toward zero (`_convert_float` with no rounding mode): at most one
    bf16 step, 2^-7 |want|. lse and indexer scores are fp32 outputs: fp32 tolerance.
    bf16 queries over a bf16 pool take the tensor-core form (_dot.py, MMA; in the interpreter its
    fp32 form of bf16-rounded operands): the softmax weights P are rounded to bf16 (relative 2^-9,
    nearest even in both forms) before the PV dot, which moves out by at most
    2^-9 sum_j p_j |v_j| / denominator <= 2^-9 max_j |v_j| over the row's keys."""
    rounding = 2 ** -8 if device.type == "cuda" else 2 ** -7
    for case in [(3, 4, 32, 20, 9, 1, 1), (4, 8, 16, 10, 8, 50, 5), (7, 16, 64, 40, 17, 64, 20)]:
        args = decode_case(*case, seed=sum(case), device=device, kv_dtype="bfloat16")
        q = args.pop("q").bfloat16()
        assert args["kv"].storage.dtype == args["extra_kv"].storage.dtype == torch.bfloat16
        want, want_lse = ref_sparse_decode(q.float(), **args)
        with LaunchRecorder(run=None) as rec:  # records the launch's constexprs, runs it
            got, got_lse = kernels.sparse_decode(q, **args)
        # the launch took the tensor-core form (under the interpreter: its fp32 form of bf16 operands)
        assert device.type != "cpu" or [s.constexpr("MMA") for s in rec.specs] == [True]
        assert got.dtype == torch.bfloat16
        vmax = torch.cat([args["kv"].read(torch.arange(args["kv"].num_slots, device=device)).abs().amax().view(1),
                          args["extra_kv"].read(torch.arange(args["extra_kv"].num_slots, device=device)).abs().amax().view(1)]).max()
        excess = ((got.float() - want).abs() - (rounding * want.abs() + 2 ** -9 * vmax + 1e-5)).max()
        assert excess <= 0, f"{case=}: error exceeds one bf16 rounding by {excess:.2e}"
        assert torch.allclose(got_lse, want_lse, **TOL), f"{case=}"
    gen = torch.Generator().manual_seed(8)
    q, w, keys = torch.randn(6, 8, 32, generator=gen).bfloat16(), torch.randn(6, 8, generator=gen), \
        torch.randn(300, 32, generator=gen)
    pool = pool_of(keys.to(device), "bfloat16")
    cand = torch.randint(-1, 300, (6, 300), generator=gen, dtype=torch.int32).to(device)
    with LaunchRecorder(run=None) as rec:
        got = kernels.indexer_gather_scores(q.to(device), w.to(device), pool, cand, 32 ** -0.5)
    assert device.type != "cpu" or [s.constexpr("MMA") for s in rec.specs] == [True]  # exact products: fp32 TOL
    want = ref_indexer_gather_scores(q.float().to(device), w.to(device), pool, cand, 32 ** -0.5)
    assert torch.allclose(got, want, **TOL)
