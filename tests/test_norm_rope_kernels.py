"""The attention rows' norm / RoPE kernels (kernels/norm_rope.py) and the SWA K=V writer
(kernels/kv_write.py) against their references (reference/norm_rope.py), fp32 and bf16.

The kernels compute the references' operations in the same order (the pairwise mean square,
correctly rounded sqrt and division, transformers' products and sums, one rounding to the row's
dtype where transformers casts), so kernel and reference are compared bit for bit, and the
writer's pool bytes (FP8 records and every untouched byte) byte for byte with the torch writer's.
A kernel that truncated a bf16 rounding, summed in another order or contracted a multiply-add
would differ in the last bit of some element here. The references are pinned to transformers: the
RoPE bitwise to apply_rotary_pos_emb, the norms to the modules' formula in float64 within the
rounding bound of the two pinned choices (docstring of the norm test)."""
import math
import os
import subprocess
import sys

import pytest
import torch

import dsv4_tree as dt
from dsv4_tree import kernels
from dsv4_tree.attention.backend import TORCH_OPS, get_backend
from dsv4_tree.attention.layer import RowRope
from dsv4_tree.diagnostics import LaunchCounter
from dsv4_tree.hf_bindings import apply_rotary_pos_emb
from dsv4_tree.numerics.rope import apply_rope
from dsv4_tree.reference.norm_rope import ref_kv_write, ref_norm_rope, ref_rms_norm, ref_rope
from dsv4_tree.serving.kv_pool import KVPool

U = 2.0**-24  # fp32 unit roundoff
DTYPES = [torch.float32, torch.bfloat16]


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32 if x.dtype == torch.float32 else torch.int16)


def rows(shape, dtype, seed, device):
    """Rows with a wide spread of magnitudes across rows and channels (and one all-zero row)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-6, 7, shape[:-1] + (1,), generator=g).float())
    x = x * torch.exp2(torch.randint(-3, 4, shape, generator=g).float())
    x[0] = 0.0
    return x.to(dtype).to(device)


def tables(t, half, dtype, seed, device):
    g = torch.Generator().manual_seed(seed)
    ang = torch.rand(t, half, generator=g) * 2 * math.pi
    return ang.cos().to(dtype).to(device), ang.sin().to(dtype).to(device)


def weight(d, dtype, seed, device):
    g = torch.Generator().manual_seed(seed)
    return (1.0 + 0.1 * torch.randn(d, generator=g)).to(dtype).to(device)


# (T, H, D, half): q_a_norm-like rows (H = 1, D not a power of two), heads, V4-sized heads, V4-Pro's
# q_a_norm width (1536: the pair tree in 32 rows of 64, then over the rows)
SHAPES = [(5, 1, 48, 0), (4, 3, 32, 4), (3, 2, 24, 6), (2, 2, 512, 32), (2, 1, 1536, 0)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_norm_rope_equals_the_reference_bitwise(dtype, shape, device):
    t, h, d, half = shape
    x = rows((t, h, d), dtype, seed=d + h, device=device)
    w = weight(d, dtype, seed=d, device=device)
    cos, sin = tables(t, half, dtype, seed=t, device=device)
    cases = {"weighted": dict(eps=1e-6, weight=w), "unweighted": dict(eps=1e-6)}
    if half:
        cases.update({"unweighted + rope": dict(eps=1e-6, cos=cos, sin=sin),
                      "weighted + rope": dict(eps=1e-6, weight=w, cos=cos, sin=sin),
                      "rope": dict(cos=cos, sin=sin), "inverse rope": dict(cos=cos, sin=sin, inverse=True)})
    for name, args in cases.items():
        got = kernels.norm_rope(x, **args)
        want = ref_norm_rope(x, **args)
        assert got.dtype == dtype and got.shape == x.shape and got.is_contiguous(), (name, got.dtype, got.shape)
        diff = int((bits(got) != bits(want)).sum())
        assert diff == 0, f"{name} {shape=} {dtype=}: {diff} elements differ from the reference"
    if h == 1:  # [T, D] rows as q_a_norm takes them
        got = kernels.norm_rope(x[:, 0], 1e-6, w)
        assert torch.equal(bits(got), bits(ref_norm_rope(x[:, 0], 1e-6, w)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_rope_reads_strided_rows(dtype, device):
    """The indexer query arrives as a [T, H, d] view of a [1, T, H, d] projection's transposes."""
    t, h, d, half = 4, 3, 16, 4
    base = rows((h, t, d), dtype, seed=5, device=device)
    x = base.transpose(0, 1)  # strides (d, t * d, 1)
    cos, sin = tables(t, half, dtype, seed=6, device=device)
    got = kernels.norm_rope(x, cos=cos, sin=sin)
    assert got.is_contiguous() and torch.equal(bits(got), bits(ref_rope(x.contiguous(), cos, sin)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inverse", [False, True])
def test_reference_rope_is_transformers_apply_rotary_pos_emb(dtype, inverse):
    t, h, d, half = 5, 3, 32, 8
    x = rows((t, h, d), dtype, seed=9, device="cpu")
    cos, sin = tables(t, half, dtype, seed=10, device="cpu")
    # transformers takes x [B, H, T, d] and cos / sin [B, T, half]; the inverse passes -sin
    hf = apply_rotary_pos_emb(x.transpose(0, 1).unsqueeze(0), cos.unsqueeze(0), -sin.unsqueeze(0) if inverse
                              else sin.unsqueeze(0))[0].transpose(0, 1)
    assert torch.equal(bits(ref_rope(x, cos, sin, inverse)), bits(hf.contiguous()))
    # and the torch backend's rope (full-width tables) gives the same values
    full = RowRope({"main": (cos, sin)}).full("main", d, inverse=inverse)
    torch_path = apply_rope(x.transpose(0, 1).unsqueeze(0), *full)[0].transpose(0, 1)
    assert torch.equal(torch_path, ref_rope(x, cos, sin, inverse))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weighted", [True, False])
def test_reference_norms_follow_the_modules_formula(dtype, weighted):
    """ref_rms_norm against transformers' formula evaluated in float64 (x * rsqrt(mean(x^2) + eps),
    times the weight). Bound, relative to the exact value: the pairwise sum of D nonnegative
    squares rounds once per level (L = ceil(log2 D) levels: L u), the division by D and the + eps
    one u each, sqrt u, the division 1 / sqrt u (r within (L + 4) u), then x * r and the weight
    product u each: (L + 6) u. A bf16 result rounds to bf16 (8 significant bits: 2^-8 relative)
    once when weighted, twice when not (r, then the product: 2^-7 + 2^-16). A missing weight, a
    misplaced eps or cast, or a mean over the wrong axis is far outside."""
    for d in (24, 48, 512):
        x = rows((6, d), dtype, seed=d, device="cpu")
        w = weight(d, dtype, seed=d + 1, device="cpu") if weighted else None
        eps = 1e-6
        x64 = x.double()
        exact = x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + eps)
        if weighted:
            exact = w.double() * exact
        levels = math.ceil(math.log2(d))
        rel = (levels + 6) * U
        if dtype == torch.bfloat16:
            rel += 2.0**-8 if weighted else 2.0**-7 + 2.0**-16
        got = ref_rms_norm(x, eps, w).double()
        err = (got - exact).abs()
        worst = float((err / exact.abs().clamp_min(1e-300)).max())
        assert (err <= rel * exact.abs()).all(), f"{d=} {dtype=} {weighted=}: worst relative {worst} > {rel}"


KV_CASES = [("fp8_e4m3", 32, 8, 16), ("fp8_e4m3", 136, 8, 16), ("fp8_e4m3", 512, 64, 4), ("bfloat16", 32, 8, 16),
            ("auto", 32, 8, 16)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", KV_CASES)
def test_kv_write_equals_the_torch_writer_bytewise(dtype, case, device):
    kv_dtype, d, rope_dim, page_size = case
    t, slots_total = 7, 40

    def pool():
        return KVPool(slots_total, d, rope_dim, kv_dtype, page_size, device, dtype)

    got, want, torch_rope = pool(), pool(), pool()
    slots = torch.tensor([3, 17, 0, 39, 22, 16, 5], device=device)
    kv = rows((t, d), dtype, seed=d + page_size, device=device)
    w = weight(d, dtype, seed=d, device=device)
    cos, sin = tables(t, rope_dim // 2, dtype, seed=3, device=device)
    kernels.kv_write(got, slots, kv, w, 1e-6, cos, sin)
    ref_kv_write(want, slots, kv, w, 1e-6, cos, sin)
    g, r = got.storage.view(torch.uint8), want.storage.view(torch.uint8)
    diff = int((g != r).sum())
    assert diff == 0, f"{case=} {dtype=}: {diff} pool bytes differ from the torch writer's"
    # the torch backend's own RoPE (full-width tables) and KVPool.write over the same normed rows
    full = RowRope({"main": (cos, sin)}).full("main", d)
    normed = ref_rms_norm(kv, 1e-6, w)
    torch_rope.write(slots, apply_rope(normed.view(1, 1, t, d), *full)[0, 0])
    assert torch.equal(torch_rope.storage.view(torch.uint8), g), f"{case=} {dtype=}"


def test_kv_write_takes_a_strided_projection_and_int32_slots(device):
    d, rope_dim = 32, 8
    got, want = (KVPool(16, d, rope_dim, "fp8_e4m3", 8, device, torch.bfloat16) for _ in range(2))
    wide = rows((5, 2 * d), torch.bfloat16, seed=2, device=device)
    kv = wide[:, :d]  # row stride 2 d
    w = weight(d, torch.bfloat16, seed=3, device=device)
    cos, sin = tables(5, rope_dim // 2, torch.bfloat16, seed=4, device=device)
    slots = torch.tensor([9, 1, 14, 4, 0], dtype=torch.int32, device=device)
    kernels.kv_write(got, slots, kv, w, 1e-6, cos, sin)
    ref_kv_write(want, slots.long(), kv.contiguous(), w, 1e-6, cos, sin)
    assert torch.equal(got.storage, want.storage)


def _tiny_attention(dtype, t):
    """The SWA attention module of a tiny random model and its rotary module's (cos, sin) [T, half]
    at positions 40.. (the verify rows' RowRope.pair("main"))."""
    from dsv4_tree.checkpoint.tiny import random_model

    cfg = dt.tiny_config(num_hidden_layers=1, layer_types=["sliding_attention"], mlp_layer_types=["moe"])
    hf = random_model(cfg, seed=1).to(dtype).model
    like = torch.zeros(1, t, cfg.hidden_size, dtype=dtype)
    cos, sin = hf.rotary_emb(like, position_ids=torch.arange(40, 40 + t).unsqueeze(0), layer_type="main")
    return hf.layers[0].self_attn, cos[0], sin[0]


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_row_ops_are_the_kernels_on_pair_tables(dtype):
    """The Triton backend's q_rows / swa_write / rope_rows: the model's projections, then the
    kernels with the module's eps and weights, from RowRope.pair (RowRope.full never widens)."""
    t = 5
    attn, cos, sin = _tiny_attention(dtype, t)
    h, d, rope_dim = attn.num_heads, attn.head_dim, 2 * cos.shape[1]
    x = torch.randn(1, t, attn.config.hidden_size, generator=torch.Generator().manual_seed(1)).to(dtype)
    rope = RowRope({"main": (cos, sin)})
    ops = get_backend("triton")
    with torch.inference_mode():
        q_res, q = ops.q_rows(attn, x, rope)
        want_res = ref_rms_norm(attn.q_a_proj(x), attn.q_a_norm.variance_epsilon, attn.q_a_norm.weight)
        assert torch.equal(bits(q_res), bits(want_res))
        want_q = ref_norm_rope(attn.q_b_proj(want_res).view(t, h, d), attn.q_b_norm.eps, cos=cos, sin=sin)
        assert q.shape == (t, h, d) and torch.equal(bits(q), bits(want_q))
        got_pool, want_pool = (KVPool(16, d, rope_dim, "fp8_e4m3", 8, "cpu", dtype) for _ in range(2))
        slots = torch.tensor([2, 7, 11, 0, 15])
        ops.swa_write(attn, x, rope, got_pool, slots)
        ref_kv_write(want_pool, slots, attn.kv_proj(x)[0], attn.kv_norm.weight, attn.kv_norm.variance_epsilon, cos, sin)
        assert torch.equal(got_pool.storage, want_pool.storage)
        out = ops.rope_rows(q.transpose(0, 1).unsqueeze(0), rope, "main", inverse=True)  # [1, H, T, d]
        assert out.shape == (1, h, t, d) and out.transpose(1, 2).is_contiguous()
        assert torch.equal(bits(out[0].transpose(0, 1)), bits(ref_rope(q, cos, sin, inverse=True)))
    assert not rope.widened, "the Triton path widened a RoPE table (RowRope.full)"
    assert TORCH_OPS.q_rows is not ops.q_rows and TORCH_OPS.swa_write is not ops.swa_write


def test_on_meta_the_launchers_allocate_and_launch_nothing():
    x = torch.empty(8, 4, 512, dtype=torch.bfloat16, device="meta")
    cos = torch.empty(8, 32, dtype=torch.bfloat16, device="meta")
    pool = KVPool(64, 512, 64, "fp8_e4m3", 64, "meta", torch.bfloat16)
    with LaunchCounter(device="meta") as c:
        out = kernels.norm_rope(x, 1e-6, cos=cos, sin=cos)
        kernels.kv_write(pool, torch.empty(8, dtype=torch.int64, device="meta"), x[:, 0],
                         torch.empty(512, device="meta"), 1e-6, cos, cos)
    assert out.device.type == "meta" and out.shape == x.shape and out.dtype == x.dtype
    assert c.total == 0, dict(c.by_name)


def test_bad_inputs_name_the_argument():
    x = torch.randn(4, 2, 32)
    cos, sin = torch.randn(4, 4), torch.randn(4, 4)
    w = torch.ones(32)
    bad = [
        (lambda: kernels.norm_rope(torch.randn(32), 1e-6), "x must be"),
        (lambda: kernels.norm_rope(x.half(), 1e-6), "x must have dtype"),
        (lambda: kernels.norm_rope(x.transpose(1, 2), 1e-6), "unit channel stride"),
        (lambda: kernels.norm_rope(x, 1e-6, torch.ones(31)), "weight must be"),
        (lambda: kernels.norm_rope(x, weight=w), "weight without eps"),
        (lambda: kernels.norm_rope(x, torch.tensor(1e-6)), "eps must be a Python float"),
        (lambda: kernels.norm_rope(x, cos=cos), "cos and sin"),
        (lambda: kernels.norm_rope(x, cos=cos, sin=torch.randn(4, 3)), "cos and sin"),
        (lambda: kernels.norm_rope(x, cos=torch.randn(3, 4), sin=torch.randn(3, 4)), "T=4"),
        (lambda: kernels.norm_rope(x, cos=torch.randn(4, 17), sin=torch.randn(4, 17)), "width 32"),
        (lambda: kernels.norm_rope(x, cos=torch.zeros(4, 4, dtype=torch.int32), sin=sin), "cos must have dtype"),
        (lambda: kernels.norm_rope(x), "got neither"),
        (lambda: kernels.norm_rope(x, cos=cos.to("meta"), sin=sin.to("meta")), "different devices"),
    ]
    pool = KVPool(16, 32, 8, "fp8_e4m3", 8, "cpu", torch.float32)
    kv, slots = torch.randn(4, 32), torch.arange(4)
    bad += [
        (lambda: kernels.kv_write(KVPool(16, 32, 8, "fp8_e4m3", 8, "cpu", torch.float32, kind="index_key"),
                                  slots, kv, w, 1e-6, cos, sin), "kind 'kv'"),
        (lambda: kernels.kv_write(pool, slots, torch.randn(4, 16), w, 1e-6, cos, sin), "kv must be"),
        (lambda: kernels.kv_write(pool, slots[:3], kv, w, 1e-6, cos, sin), "slots must be"),
        (lambda: kernels.kv_write(pool, slots.float(), kv, w, 1e-6, cos, sin), "slots must have dtype"),
        (lambda: kernels.kv_write(pool, slots, kv, torch.ones(16), 1e-6, cos, sin), "weight must be"),
        (lambda: kernels.kv_write(pool, slots, kv, w, None, cos, sin), "eps must be"),
        (lambda: kernels.kv_write(pool, slots, kv, w, 1e-6, torch.randn(4, 2), torch.randn(4, 2)), "rope_dim 8"),
        (lambda: kernels.kv_write(pool, slots, kv.to("meta"), w, 1e-6, cos, sin), "different devices"),
    ]
    for call, message in bad:
        with pytest.raises(dt.InputError, match=message):
            call()


def test_kernel_names_survive_a_kernel_module_importing_another():
    """kv_write imports fp8_store's (and norm_rope's) jit helpers; importing those submodules must
    not rebind the package's kernel names to the modules (a fresh interpreter: import order)."""
    code = ("import types; from dsv4_tree import kernels; kernels.kv_write; "
            "assert all(isinstance(getattr(kernels, n), types.FunctionType) for n in ('fp8_store', 'norm_rope')), "
            "(kernels.fp8_store, kernels.norm_rope)")
    env = {**os.environ, "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1")}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
