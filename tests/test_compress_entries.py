"""kernels/compress_entries.py: a compressor's rows (one launch, bit copies) and every row's entry
(one launch: gather by slot, position bias, fp32 softmax pooling, kv_norm, RoPE at the block
start, the entry pool's store) against reference/compress_entries.py and the torch writer.
C4's overlap and C128 layouts, null rows before position 0, rows on a branch, rows that close no
block (trash), fp32 and bf16 models, plain and FP8 entry pools (K=V records and indexer keys)."""
import dataclasses
import types

import pytest
import torch
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RMSNorm

import dsv4_tree as dt
from dsv4_tree import kernels
from dsv4_tree.diagnostics import LaunchCounter
from dsv4_tree.reference.compress_entries import ref_block_rows, ref_compress_entries
from dsv4_tree.serving.kv_pool import KVPool
from dsv4_tree.serving.pools import CompressorPools
from dsv4_tree.serving.tables import CompressTables

N_ENTRIES, PAGE = 16, 4  # entry pool slots (the last one is the trash slot), page size (slots span pages)
EPS = 1e-6


def make_case(ratio, overlap, d, half, dtype, seed, device, exact=False, params=None):
    """Row pools over a committed path of 3 blocks and a branch that leaves it after block 0; rows
    closing blocks 0..2 on the path (block 0: C4's previous block is before position 0, null rows)
    and 1..2 on the branch, and two rows that close no block (trash: every source row the trash
    slot, the entry to the trash entry slot). params: the dtype of the position bias and the norm
weight (default: the model's; transformers keeps them fp32 in a bf16 model it loads).
Random gates are 64x larger on odd channels: there a gate + bias rounded or not to a bf16
model's dtype moves the softmax weights by far more than the bound. -> (rows_kv, rows_gate, ct,
module, cos, sin).

    exact: gate + bias equal on a channel's live rows (softmax weights 1/n, n = m or 2m: a power of
    two) and kv multiples of 1/4 in [-1, 1]: every fp32 sum of the pooling and of the norm's mean
    of squares is then exact in any order (at most 24 significant bits at these shapes), so
    kernel and reference pool the same value and compute the same roundings from there on (the
    pooled value, up to 10 significant bits, still rounds to a bf16 model's dtype)."""
    gen = torch.Generator().manual_seed(seed)
    m, w = ratio, (2 * d if overlap else d)
    paths = {"main": list(range(3 * m)), "branch": list(range(m)) + list(range(3 * m, 5 * m))}  # position -> slot
    trash = 5 * m
    n_slots = trash + 1

    def dyadic(*shape, top):
        return torch.randint(-top, top + 1, shape, generator=gen).double() / 8

    if exact:
        g = dyadic(w, top=16)
        if overlap:  # a row pools the previous block's first half with this block's second: one G
            g[d:] = g[:d]
        bias = dyadic(m, w, top=8)
        kv = torch.randint(-4, 5, (n_slots, w), generator=gen).double() / 4
        gate = torch.zeros(n_slots, w, dtype=torch.float64)
        for slots in paths.values():
            for q, slot in enumerate(slots):
                gate[slot] = g - bias[q % m]
        gate[trash] = g
    else:
        kv, gate = torch.randn(n_slots, w, generator=gen), torch.randn(n_slots, w, generator=gen)
        gate[:, 1::2] *= 64
        bias = torch.randn(m, w, generator=gen)
    rows = [("main", m - 1), ("main", 2 * m - 1), ("main", 3 * m - 1), ("branch", 2 * m - 1), ("branch", 3 * m - 1),
            (None, 0), (None, 0)]
    r = 2 * m if overlap else m
    src, start = [], []
    for path, p in rows:
        if path is None:
            src.append([trash] * r)
            start.append(0)
            continue
        block = (p + 1) // m - 1
        first = (block - 1) * m if overlap else block * m
        src.append([paths[path][q] if q >= 0 else -1 for q in range(first, first + r)])
        start.append(block * m)
    t = len(rows)
    out = torch.randperm(N_ENTRIES - 1, generator=gen)[:t]
    out[-2:] = N_ENTRIES - 1
    angle = torch.tensor(start, dtype=torch.float64)[:, None] * 10000.0 ** (-torch.arange(half) / half)[None]
    norm = DeepseekV4RMSNorm(d, EPS)
    params = params or dtype
    norm.weight.data = (1 + 0.25 * torch.randn(d, generator=gen)).to(params)
    module = types.SimpleNamespace(position_bias=bias.to(params).to(device), kv_norm=norm.to(device))
    kw = dict(device=device)
    ct = CompressTables(m, None, out.to(**kw), torch.tensor(start, **kw), torch.tensor(src, **kw), None, 1, None,
                        None, None)
    return (kv.to(dtype).to(device), gate.to(dtype).to(device), ct, module, angle.cos().to(dtype).to(device),
            angle.sin().to(dtype).to(device))


def pools_of(case, kv_dtype, kind, noise_seed=None):
    """A CompressorPools over the case's row pools with a fresh entry pool (bytes random when
    noise_seed is given: bytes no write touches must stay as they were)."""
    rows_kv, rows_gate, ct, module, cos, sin = case
    d = module.kv_norm.weight.shape[0]
    rope = 2 * cos.shape[1] if kind == "kv" else 0
    entries = KVPool(N_ENTRIES, d, rope, kv_dtype, PAGE, rows_kv.device, rows_kv.dtype, kind=kind)
    if noise_seed is not None:
        flat = entries.storage.view(torch.uint8)
        gen = torch.Generator().manual_seed(noise_seed)
        flat.copy_(torch.randint(0, 256, flat.shape, generator=gen, dtype=torch.uint8))
        if entries.record is None and entries.storage.dtype != torch.uint8:  # plain pools: finite values
            entries.storage.copy_(torch.randn(entries.storage.shape, generator=gen))
    return CompressorPools(ct.ratio, rows_kv.shape[1] != d, d, rows_kv.clone(), rows_gate.clone(), entries)


def on_cpu(case):
    return tuple(dataclasses.replace(x, **{f.name: getattr(x, f.name).cpu() for f in dataclasses.fields(x)
                                           if isinstance(getattr(x, f.name), torch.Tensor)})
                 if dataclasses.is_dataclass(x) else
                 types.SimpleNamespace(position_bias=x.position_bias.cpu(), kv_norm=x.kv_norm.cpu())
                 if isinstance(x, types.SimpleNamespace) else x.cpu() for x in case)


def reference(case, kind="kv"):
    """The reference's entries [T, d], on the CPU (torch's CPU rsqrt is the correctly rounded 1/sqrt
    the kernel computes, on every device)."""
    cpu = on_cpu(case)
    return ref_compress_entries(pools_of(cpu, "auto", kind), cpu[2], cpu[3], cpu[4], cpu[5])


U = 2.0 ** -24  # fp32 unit roundoff
UNIT = {torch.float32: 0.0, torch.bfloat16: 2.0 ** -8}  # the model dtype's roundoff (fp32: no extra rounding)


def entry_bound(case) -> torch.Tensor:
    """Per element, a bound on |kernel - reference| [T, d], derived from the operations; everything
    after the pooling is the same operation in the same order on both sides, so the only source is
    the pooling's fp32 rounding order, carried through:
    * pooled x_c = sum_r w_r kv_rc: exp within a few ulps on either side (and, on a GPU, an error
      growing with the exponent's size: R u max|kv| covers it), sums over R rows in different
      orders: |dx_c| <= eta_c = (4R + 24) u A_c + R u max_r |kv_rc|, A_c = sum_r w_r |kv_rc|; the
      rounding to the model dtype can then land on neighbouring values: xi_c = eta_c (1 + 2v) + 2v |x_c|;
    * the norm y = w x rho, rho = (mean x^2 + eps)^-1/2: |d rho| <= rho^3 / D sum_c (|x_c| xi_c +
      xi_c^2 / 2) plus its own fp32 roundings ((D + 8) u rho over both sides); |dy_c| <= |w_c| (xi_c
      rho + (|x_c| + xi_c) |d rho|) + 4u |y_c|, then the rounding: + 2v (|y_c| + |dy_c|);
    * RoPE (e, o) -> (e c - o s, o c + e s): |de'| <= |c| |de| + |s| |do| + 6u (|c e| + |s o|),
      then the rounding: + 2v (|e'| + |de'|); the nope channels pass unchanged.
    The sum of first-order terms is doubled to cover the second-order ones."""
    rows_kv, rows_gate, ct, module, cos, sin = on_cpu(case)
    dtype = rows_kv.dtype
    overlap = rows_kv.shape[1] != module.kv_norm.weight.shape[0]
    kv, gate = (t.double() for t in ref_block_rows(rows_kv, rows_gate, ct.src, module.position_bias, ct.ratio,
                                                    overlap))
    r, v = kv.shape[1], UNIT[dtype]
    w8 = torch.softmax(gate, dim=1)
    a, x = (w8 * kv.abs()).sum(1), (w8 * kv).sum(1)  # [T, D]
    xi = ((4 * r + 24) * U * a + r * U * kv.abs().amax(1)) * (1 + 2 * v) + 2 * v * x.abs()
    dim = x.shape[1]
    rho = (x.pow(2).mean(1, keepdim=True) + EPS) ** -0.5
    drho = rho ** 3 / dim * (x.abs() * xi + xi ** 2 / 2).sum(1, keepdim=True) + (dim + 8) * U * rho
    wt = module.kv_norm.weight.double().abs()
    y = wt * x.abs() * rho
    dy = wt * (xi * rho + (x.abs() + xi) * drho) + 4 * U * y
    dy = dy + 2 * v * (y + dy)
    c, s = cos.double().abs(), sin.double().abs()
    nope = dim - 2 * cos.shape[1]
    ye, yo, de, do = y[:, nope::2], y[:, nope + 1::2], dy[:, nope::2], dy[:, nope + 1::2]
    bound = dy.clone()
    for col, (d1, d2, y1, y2) in ((nope, (de, do, ye, yo)), (nope + 1, (do, de, yo, ye))):
        b = c * d1 + s * d2 + 6 * U * (c * y1 + s * y2)
        bound[:, col::2] = b + 2 * v * (c * y1 + s * y2 + b)
    return 2 * bound


def launch(pool, case):
    kernels.compress_entries(pool, case[2], case[3], case[4], case[5])


SHAPES = [(4, True, 32, 4), (4, True, 16, 4), (128, False, 32, 4), (16, False, 40, 8), (4, True, 136, 4)]
SHAPE_IDS = ["c4", "c4-indexer", "c128", "odd-width", "c4-two-tiles"]


@pytest.mark.parametrize("dtype,params", [(torch.float32, None), (torch.bfloat16, None),
                                          (torch.bfloat16, torch.float32)], ids=["fp32", "bf16", "bf16-fp32-params"])
@pytest.mark.parametrize("ratio,overlap,d,half", SHAPES, ids=SHAPE_IDS)
def test_entries_match_the_reference_within_the_pooling_bound(ratio, overlap, d, half, dtype, params, device):
    case = make_case(ratio, overlap, d, half, dtype, seed=d + ratio, device=device, params=params)
    pool = pools_of(case, "auto", "kv")
    launch(pool, case)
    got = pool.entries.storage[case[2].entry_out].double().cpu()  # trash rows: the trash slot's one entry
    want = reference(case).double()
    bound = entry_bound(case)
    err = (got - want).abs()
    worst = (err / bound).max().item()
    assert (err <= bound).all(), f"{ratio=} {overlap=} {d=} {dtype=}: worst |diff| / bound {worst:.3g}"
    # the bound is no formality: it is far below what a wrong row, bias or channel would give
    assert (bound <= 0.25 * want.abs().amax(1, keepdim=True)).all(), f"{ratio=} {d=} {dtype=}: bound too loose"


EXACT = [(4, True, 32, 4, "kv"), (4, True, 16, 4, "index_key"), (128, False, 32, 4, "kv"), (16, False, 40, 8, "kv"),
         (4, True, 136, 4, "kv"), (4, True, 256, 4, "index_key")]


@pytest.mark.parametrize("dtype,kv_dtype", [(torch.float32, "auto"), (torch.float32, "bfloat16"),
                                            (torch.float32, "fp8_e4m3"), (torch.bfloat16, "auto"),
                                            (torch.bfloat16, "fp8_e4m3")])  # a bf16 model's "bfloat16" is "auto"
@pytest.mark.parametrize("ratio,overlap,d,half,kind", EXACT)
def test_exact_pooling_gives_the_torch_writers_bytes(ratio, overlap, d, half, kind, dtype, kv_dtype, device):
    """Where the pooling is exact on both sides, every later step is the same operation in the same
    order: the entry pool's bytes are the torch writer's (KVPool.write) of the reference's entries,
    bit for bit, and no other byte changes. The trash slot (pooled from one row under different
    biases: not exact) is overwritten with zeros in both pools first."""
    case = make_case(ratio, overlap, d, half, dtype, seed=3 * d + ratio, device=device, exact=True)
    got = pools_of(case, kv_dtype, kind, noise_seed=d)
    launch(got, case)
    want = pools_of(on_cpu(case), kv_dtype, kind, noise_seed=d)
    closing = case[2].entry_out.cpu() != N_ENTRIES - 1
    want.entries.write(case[2].entry_out.cpu()[closing], reference(case, kind)[closing])
    trash = torch.tensor([N_ENTRIES - 1])
    zero = torch.zeros(1, d, dtype=dtype)
    want.entries.write(trash, zero)
    got.entries.write(trash.to(device), zero.to(device))
    same = got.entries.storage.cpu().view(torch.uint8) == want.entries.storage.view(torch.uint8)
    assert same.all(), f"{ratio=} {d=} {kind=} {dtype=} {kv_dtype=}: {int((~same).sum())} bytes differ"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ratio,overlap,d,half,kind", EXACT)
def test_fp8_records_are_the_torch_writers_of_the_kernels_entries(ratio, overlap, d, half, kind, dtype, device):
    """Any inputs: the FP8 records the kernel stores are byte-equal to the torch writer's given the
    entries the kernel computes (read back exactly from a plain pool of the model dtype)."""
    case = make_case(ratio, overlap, d, half, dtype, seed=5 * d + ratio, device=device)
    plain = pools_of(case, "auto", kind)
    launch(plain, case)
    entries = plain.entries.storage[case[2].entry_out]  # trash rows: all the same entry
    got = pools_of(case, "fp8_e4m3", kind, noise_seed=1)
    launch(got, case)
    want = pools_of(case, "fp8_e4m3", kind, noise_seed=1)
    want.entries.write(case[2].entry_out, entries)  # no use_kernels: the torch writer
    same = got.entries.storage == want.entries.storage
    assert same.all(), f"{ratio=} {d=} {kind=} {dtype=}: {int((~same).sum())} bytes differ"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("overlap", [True, False])
def test_row_writes_are_index_copy_bit_for_bit(overlap, dtype, device):
    case = make_case(4, overlap, 32, 4, dtype, seed=7, device=device)
    pool, want = pools_of(case, "auto", "kv"), pools_of(case, "auto", "kv")
    gen = torch.Generator().manual_seed(8)
    t, w = 5, pool.rows_kv.shape[1]
    kv, gate = torch.randn(t, w, generator=gen) * 1e3, torch.randn(2 * t, w, generator=gen)[::2]  # strided rows
    kv[0, :4] = torch.tensor([0.0, -0.0, 1e-40, -3e38])  # signed zeros, a subnormal, a large value
    slots = torch.randperm(pool.rows_kv.shape[0], generator=gen)[:t]
    kv, gate, slots = kv.to(dtype).to(device), gate.to(dtype).to(device), slots.to(device)
    kernels.write_compressor_rows(pool, slots, kv, gate)
    want.write_rows(slots, kv, gate)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    for name in ("rows_kv", "rows_gate"):
        assert torch.equal(getattr(pool, name).view(bits), getattr(want, name).view(bits)), f"{name} {dtype=}"


def test_bad_inputs_raise_input_error_naming_the_argument(device):
    case = make_case(4, True, 32, 4, torch.float32, seed=9, device=device)
    rows_kv, rows_gate, ct, module, cos, sin = case
    pool = pools_of(case, "auto", "kv")
    bad = [
        ("ct.ratio", dict(ct=dataclasses.replace(ct, ratio=8))),
        ("ct.src", dict(ct=dataclasses.replace(ct, src=ct.src[:, :-1]))),
        ("ct.src", dict(ct=dataclasses.replace(ct, src=ct.src.float()))),
        ("ct.entry_out", dict(ct=dataclasses.replace(ct, entry_out=ct.entry_out[:-1]))),
        ("cos", dict(cos=cos[:-1])),
        ("sin", dict(sin=sin[:, :-1])),
        ("module.position_bias", dict(module=types.SimpleNamespace(position_bias=module.position_bias[:, :32],
                                                                   kv_norm=module.kv_norm))),
        ("module.kv_norm.weight", dict(module=types.SimpleNamespace(position_bias=module.position_bias,
                                                                    kv_norm=DeepseekV4RMSNorm(16).to(device)))),
        ("pool.entries", dict(pool=dataclasses.replace(pool, entries=KVPool(4, 16, 8, "auto", PAGE, device,
                                                                            torch.float32)))),
        ("pool.rows_gate", dict(pool=dataclasses.replace(pool, rows_gate=rows_gate.double()))),
    ]
    for name, change in bad:
        args = dict(pool=pool, ct=ct, module=module, cos=cos, sin=sin, **{})
        args.update(change)
        with pytest.raises(dt.InputError, match=name.replace(".", r"\.")):
            kernels.compress_entries(**args)
    t, w = ct.src.shape[0], rows_kv.shape[1]
    slots, kv = ct.entry_out, torch.zeros(t, w, device=device)
    for name, (s, k, g) in [("slots", (slots[None], kv, kv)), ("kv", (slots, kv.double(), kv)),
                            ("gate", (slots, kv, kv[:, :-1]))]:
        with pytest.raises(dt.InputError, match=name):
            kernels.write_compressor_rows(pool, s, k, g)


def test_on_meta_nothing_is_launched():
    case = make_case(4, True, 32, 4, torch.bfloat16, seed=10, device="meta")
    pool = pools_of(case, "fp8_e4m3", "kv")
    slots, kv = case[2].entry_out, torch.empty(case[2].src.shape[0], pool.rows_kv.shape[1], dtype=torch.bfloat16,
                                               device="meta")
    rope = types.SimpleNamespace(pair=lambda ratio: (case[4], case[5]))
    with LaunchCounter(device="meta") as c:
        kernels.compressor_write(pool, case[2], case[3], slots, kv, kv, rope)
    assert c.total == 0 and c.host == 0, dict(c.by_name)
    with pytest.raises(dt.InputError, match="cos"):  # the checks still run
        kernels.compress_entries(pool, case[2], case[3], case[4][:-1], case[5])
