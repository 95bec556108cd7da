"""Sparse decode and indexer gather scores over paged KV pools: Triton launchers vs torch references
(interpreter on CPU, small shapes), the two attention references against each other, bad input."""
import os

import pytest
import torch

from dsv4_tree.attention import torch_ops
from dsv4_tree.serving import KVPool
from dsv4_tree import kernels
from dsv4_tree.errors import InputError
from dsv4_tree.reference import ref_indexer_gather_scores, ref_sparse_decode, ref_sparse_mqa_sink

GPU = torch.cuda.is_available() and os.environ.get("DSV4_TREE_GPU") == "1"
DEV = "cuda" if GPU else "cpu"
# Both sides see identical key values: the reference reads pool.read() (dequantised rows), the
# kernel decodes the same stored bytes exactly (test_kernel_dequantises_like_pool_read checks it
# bit for bit). What remains is fp32 summation order (online softmax in tiles vs one pass):
# measured <= 1.5e-6 of the tensor's largest magnitude (key rows span 2^-6..2^6, so small outputs
# carry absolute rounding of the large keys). 1e-5 of max|expected| is far below what a wrong
# key, tile scale or length causes (>1e-2).
REL = 1e-5


def assert_close(got, want, msg, rel=REL):
    """Same non-finite entries (+-inf), finite ones within rel * max|want| (project's relative error)."""
    fin = torch.isfinite(want)
    assert torch.equal(got[~fin], want[~fin]), f"non-finite entries differ: {msg}"
    g, w = got[fin].float(), want[fin].float()
    if w.numel():
        err = float((g - w).abs().max() / w.abs().max().clamp_min(1e-30))
        assert err <= rel, f"relative error {err:.2e} > {rel:.0e}: {msg}"
DTYPES = ("auto", "bfloat16", "fp8_e4m3")


def make_pool(num_slots, head_dim, rope_dim, kv_dtype, page_size, kind="kv"):
    """The one place tests build a pool (fp32 compute dtype)."""
    return KVPool(num_slots, head_dim, rope_dim, kv_dtype, page_size, DEV, torch.float32, kind=kind)


def filled_pool(gen, num_slots, head_dim, rope_dim, kv_dtype, page_size, kind="kv"):
    """A pool whose every slot holds a random row; row magnitudes span 2^-6..2^6 (many tile exponents)."""
    pool = make_pool(num_slots, head_dim, rope_dim, kv_dtype, page_size, kind)
    rows = torch.randn(num_slots, head_dim, generator=gen)
    rows = rows * torch.exp2(torch.randint(-6, 7, (num_slots, 1), generator=gen).float())
    pool.write(torch.arange(num_slots, device=DEV), rows.to(DEV))
    return pool


def index_table(gen, rows, k, num_slots, holes=0.25):
    """[rows, k] int32 slots with -1 holes, ragged lengths [rows]; columns past a row's length hold
    real slots (they must be ignored). Row 0 has length 0; row 1 only holes."""
    idx = torch.randint(0, num_slots, (rows, k), generator=gen, dtype=torch.int32)
    idx[torch.rand(rows, k, generator=gen) < holes] = -1
    lengths = torch.randint(0, k + 1, (rows,), generator=gen, dtype=torch.int32)
    lengths[0] = 0
    if rows > 1:
        idx[1] = -1
        lengths[1] = k
    return idx.to(DEV), lengths.to(DEV)


def decode_case(kv_dtype, page_size, extra, t=6, h=4, d=136, rope=32, k=21, k2=18, seed=0, extra_dtype=None):
    gen = torch.Generator().manual_seed(seed)
    kv = filled_pool(gen, 3 * page_size + 5, d, rope, kv_dtype, page_size)
    idx, lengths = index_table(gen, t, k, kv.num_slots)
    args = dict(q=torch.randn(t, h, d, generator=gen).to(DEV), kv=kv, indices=idx, lengths=lengths,
                sinks=torch.randn(h, generator=gen).to(DEV), scale=d ** -0.5)
    if extra:
        xkv = filled_pool(gen, 2 * page_size + 3, d, rope, extra_dtype or kv_dtype, page_size)
        xidx, xlen = index_table(gen, t, k2, xkv.num_slots)
        xlen[1] = 0  # row 1: no key anywhere
        args.update(extra_kv=xkv, extra_indices=xidx, extra_lengths=xlen)
    return args


CASES = [(dt, ps, extra) for dt in DTYPES for ps in (16, 64) for extra in (False, True)]


@pytest.mark.parametrize("kv_dtype,page_size,extra", CASES)
def test_sparse_decode_matches_reference(kv_dtype, page_size, extra):
    args = decode_case(kv_dtype, page_size, extra, seed=page_size + extra)
    want_out, want_lse = ref_sparse_decode(**args)
    got_out, got_lse = kernels.sparse_decode(**args)
    msg = f"{kv_dtype=} {page_size=} {extra=}"
    assert_close(got_out, want_out, msg)
    assert_close(got_lse, want_lse, msg)
    empty = [1] if extra else [0, 1]  # rows with no key at all (see index_table, decode_case)
    assert torch.equal(got_out[empty], torch.zeros_like(got_out[empty])), msg
    assert torch.equal(got_lse[empty], torch.full_like(got_lse[empty], float("inf"))), msg
    assert torch.isfinite(want_lse[2:]).any(), msg  # the case does attend somewhere


@pytest.mark.parametrize("main_dtype,extra_dtype,d,rope", [("fp8_e4m3", "auto", 136, 32), ("bfloat16", "fp8_e4m3", 64, 16),
                                                           ("fp8_e4m3", "fp8_e4m3", 512, 64)])
def test_mixed_pools_and_v4_record(main_dtype, extra_dtype, d, rope):
    args = decode_case(main_dtype, 16, True, t=3, h=3, d=d, rope=rope, k=17, k2=9, seed=d, extra_dtype=extra_dtype)
    want_out, want_lse = ref_sparse_decode(**args)
    got_out, got_lse = kernels.sparse_decode(**args)
    assert_close(got_out, want_out, f"{main_dtype=} {extra_dtype=} {d=} {rope=}")
    assert_close(got_lse, want_lse, f"{main_dtype=} {extra_dtype=} {d=} {rope=}")


@pytest.mark.parametrize("kv_dtype", DTYPES)
@pytest.mark.parametrize("page_size", (16, 64))
def test_kernel_dequantises_like_pool_read(kv_dtype, page_size):
    # one key per row and no sink: the softmax weight is exactly 1, so out is the key row itself
    gen = torch.Generator().manual_seed(7)
    kv = filled_pool(gen, 2 * page_size + 9, 136, 32, kv_dtype, page_size)
    slots = torch.randperm(kv.num_slots, generator=gen)[:12].to(torch.int32).to(DEV)
    q = torch.randn(12, 1, 136, generator=gen).to(DEV)
    sinks = torch.full((1,), float("-inf"), device=DEV)
    out, _ = kernels.sparse_decode(q, kv, slots.view(12, 1), torch.ones(12, dtype=torch.int32, device=DEV), sinks, 0.1)
    assert torch.equal(out[:, 0], kv.read(slots.long())), f"{kv_dtype=} {page_size=}"


def test_rows_without_keys_output_zero():
    args = decode_case("fp8_e4m3", 16, True, seed=3)
    args["lengths"][:] = 0
    args["extra_indices"][:] = -1
    for out, lse in (kernels.sparse_decode(**args), ref_sparse_decode(**args)):
        assert torch.equal(out, torch.zeros_like(out))
        assert torch.equal(lse, torch.full_like(lse, float("inf")))


@pytest.mark.parametrize("fn", [ref_sparse_decode, torch_ops.sparse_decode], ids=["reference", "torch backend"])
def test_reference_supports_autograd(fn):
    """The torch backend masks some of its fresh tensors in place; gradients must still flow (the
    ones autograd keeps for backward are masked out of place)."""
    args = decode_case("auto", 16, True, seed=5)
    q, sinks = args["q"].clone().requires_grad_(True), args["sinks"].clone().requires_grad_(True)
    out, lse = fn(**{**args, "q": q, "sinks": sinks})
    (out.sum() + lse[torch.isfinite(lse)].sum()).backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(sinks.grad).all() and q.grad.abs().sum() > 0


@pytest.mark.parametrize("empty", ("indices", "extra_indices"))
def test_zero_width_index_table(empty):
    args = decode_case("fp8_e4m3", 16, True, t=4, k=5, k2=6, seed=3)
    args[empty] = args[empty][:, :0].contiguous()
    want_out, want_lse = ref_sparse_decode(**args)
    got_out, got_lse = kernels.sparse_decode(**args)
    assert_close(got_out, want_out, f"{empty=}")
    assert_close(got_lse, want_lse, f"{empty=}")


def test_bf16_queries():
    args = decode_case("bfloat16", 16, True, seed=11)
    args["q"] = args["q"].bfloat16()
    want_out, want_lse = ref_sparse_decode(**args)
    got_out, got_lse = kernels.sparse_decode(**args)
    assert got_out.dtype == torch.bfloat16
    # both compute in fp32 and cast the output to bf16: the reference rounds to nearest, the
    # kernel's cast rounds to nearest on a GPU but truncates under Triton 3.9's interpreter, so
    # they differ by at most one bf16 step (<= 2^-7 relative); lse stays fp32
    assert_close(got_out, want_out, "bf16 out", rel=2 ** -7)
    assert_close(got_lse, want_lse, "bf16 lse")


@pytest.mark.parametrize("extra", (False, True))
def test_agrees_with_ref_sparse_mqa_sink(extra):
    # same keys through the per-request reference: index lists masked by length, pools as tables
    args = decode_case("auto", 16, extra, seed=21)
    out, lse = ref_sparse_decode(**args)

    def masked(idx, lengths):
        cols = torch.arange(idx.shape[1], device=DEV)
        return torch.where(cols < lengths.unsqueeze(1), idx.long(), -1)

    d = args["q"].shape[2]
    local = masked(args["indices"], args["lengths"])
    glob_kv, glob = torch.zeros(0, d, device=DEV), torch.zeros(local.shape[0], 0, dtype=torch.long, device=DEV)
    if extra:
        glob_kv, glob = args["extra_kv"].storage, masked(args["extra_indices"], args["extra_lengths"])
    old_out, old_lse = ref_sparse_mqa_sink(args["q"], torch.zeros(0, d, device=DEV), args["kv"].storage, local,
                                           glob_kv, glob, args["sinks"], args["scale"])
    assert torch.allclose(out, old_out, rtol=1e-5, atol=1e-6)
    # old lse includes the sink; FlashMLA's excludes it (+inf when a row has no key)
    sinks = args["sinks"].view(1, -1).expand_as(lse)
    has_key = torch.isfinite(lse)
    assert torch.allclose(torch.logaddexp(lse, sinks)[has_key], old_lse[has_key], rtol=1e-5, atol=1e-6)
    assert torch.allclose(old_lse[~has_key], sinks[~has_key])


def test_ref_sparse_mqa_sink_shared_keys_agree():
    # ref_sparse_mqa_sink's three key sources (shared keys every row sees, a local table, a global
    # table) = ref_sparse_decode with the local table as main pool and shared ++ global as the
    # extra pool, each row's extra list starting with every shared slot
    gen = torch.Generator().manual_seed(23)
    t, h, d, s, m, g, k1, k2 = 5, 4, 32, 6, 12, 20, 7, 5
    q, sinks = torch.randn(t, h, d, generator=gen).to(DEV), torch.randn(h, generator=gen).to(DEV)
    shared, local, glob = (torch.randn(n, d, generator=gen).to(DEV) for n in (s, m, g))
    li = torch.randint(0, m, (t, k1), generator=gen)
    gi = torch.randint(0, g, (t, k2), generator=gen)
    li[torch.rand(t, k1, generator=gen) < 0.3] = -1
    gi[torch.rand(t, k2, generator=gen) < 0.3] = -1
    li, gi = li.to(DEV), gi.to(DEV)
    old_out, old_lse = ref_sparse_mqa_sink(q, shared, local, li, glob, gi, sinks, d ** -0.5)
    main, extra = make_pool(m, d, 0, "auto", 16), make_pool(s + g, d, 0, "auto", 16)
    main.write(torch.arange(m, device=DEV), local)
    extra.write(torch.arange(s + g, device=DEV), torch.cat([shared, glob]))
    xi = torch.cat([torch.arange(s, device=DEV).expand(t, s), torch.where(gi >= 0, gi + s, -1)], 1)
    full = lambda idx: torch.full((t,), idx.shape[1], dtype=torch.int32, device=DEV)
    out, lse = ref_sparse_decode(q, main, li.int(), full(li), sinks, d ** -0.5, extra, xi.int(), full(xi))
    assert torch.allclose(out, old_out, rtol=1e-5, atol=1e-6)  # same fp32 math, another summation order
    assert torch.allclose(torch.logaddexp(lse, sinks.view(1, -1).expand_as(lse)), old_lse, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kv_dtype,kind", [(dt, "kv") for dt in DTYPES] + [("fp8_e4m3", "index_key")])
@pytest.mark.parametrize("page_size", (16, 64))
def test_indexer_gather_matches_reference(kv_dtype, kind, page_size):
    gen = torch.Generator().manual_seed(page_size)
    d, rope = (64, 16) if kind == "kv" else (160, 0)  # index keys: two 128-blocks, one partial
    keys = filled_pool(gen, 2 * page_size + 7, d, rope, kv_dtype, page_size, kind)
    cand, _ = index_table(gen, 5, 37, keys.num_slots)
    q, w = torch.randn(5, 6, d, generator=gen).to(DEV), torch.randn(5, 6, generator=gen).to(DEV)
    want = ref_indexer_gather_scores(q, w, keys, cand, d ** -0.5)
    got = kernels.indexer_gather_scores(q, w, keys, cand, d ** -0.5)
    msg = f"{kv_dtype=} {kind=} {page_size=}"
    assert torch.equal(torch.isneginf(got), cand < 0), msg
    assert torch.equal(torch.isneginf(want), cand < 0), msg
    assert_close(got, want, msg)


@pytest.mark.parametrize("fn", [ref_indexer_gather_scores, lambda *a: torch_ops.indexer_gather_scores(*a, chunk=4)],
                         ids=["reference", "torch backend in chunks of 4"])
def test_indexer_gather_reference_equals_the_formula(fn):
    # the gather reference (and the torch backend's chunked version) over an exact pool = the
    # score formula written out per (row, candidate)
    gen = torch.Generator().manual_seed(5)
    keys = filled_pool(gen, 40, 32, 0, "auto", 16)
    cand, _ = index_table(gen, 4, 9, 40)
    q, w = torch.randn(4, 3, 32, generator=gen).to(DEV), torch.randn(4, 3, generator=gen).to(DEV)
    got = fn(q, w, keys, cand, 0.3)
    assert torch.equal(torch.isneginf(got), cand < 0)
    for t in range(4):
        for c in range(9):
            if cand[t, c] < 0:
                continue
            key = keys.storage[int(cand[t, c])]
            want = 0.3 * sum(float(w[t, h]) * max(0.0, float((q[t, h] * key).sum())) for h in range(3))
            # the same fp32 dot products summed in another order (matmul vs elementwise), ~1e-7
            # relative; 1e-5 is far below a wrong key, head weight or relu (>1e-2)
            assert abs(float(got[t, c]) - want) <= 1e-5 * max(1.0, abs(want)), f"{t=} {c=}"


def test_indexer_gather_equals_transformers_scorer():
    # transformers' DeepseekV4IndexerScorer on the same keys: weights = weights_proj(h) * H^-0.5,
    # scale = index_head_dim^-0.5 (both its own attributes), every key a candidate
    from dsv4_tree.hf_bindings import DeepseekV4Indexer
    from dsv4_tree.checkpoint.tiny import tiny_config

    torch.manual_seed(0)
    cfg = tiny_config()
    scorer = DeepseekV4Indexer(cfg).scorer
    s, e, h, d = 5, 11, cfg.index_n_heads, cfg.index_head_dim
    q, kv, hidden = torch.randn(1, s, h, d), torch.randn(1, e, d), torch.randn(1, s, cfg.hidden_size)
    with torch.no_grad():
        want = scorer(q, kv, hidden)[0]  # [S, E]
        weights = scorer.weights_proj(hidden[0]).float() * scorer.weights_scaling
    keys = make_pool(e, d, 0, "auto", 16)
    keys.write(torch.arange(e, device=DEV), kv[0].to(DEV))
    cand = torch.arange(e, dtype=torch.int32).expand(s, e).contiguous().to(DEV)
    for fn in (ref_indexer_gather_scores, kernels.indexer_gather_scores):
        got = fn(q[0].to(DEV), weights.to(DEV), keys, cand, scorer.softmax_scale)
        assert_close(got.cpu(), want, fn.__name__)


def test_bad_input_names_the_argument():
    args = decode_case("fp8_e4m3", 16, True, t=3, k=5, k2=4)
    bad = {
        "q": dict(q=args["q"][0]),
        "indices": dict(indices=args["indices"][:2]),
        "lengths": dict(lengths=args["lengths"].float()),
        "sinks": dict(sinks=args["sinks"][:1]),
        "extra_indices": dict(extra_indices=args["extra_indices"].view(-1)),
        "extra_kv": dict(extra_kv=make_pool(8, 64, 16, "auto", 16)),
        "kv": dict(kv=object()),
    }
    for name, change in bad.items():
        with pytest.raises(InputError, match=name):
            kernels.sparse_decode(**{**args, **change})
    with pytest.raises(InputError, match="scale"):
        kernels.sparse_decode(**{**args, "scale": torch.tensor(0.1)})  # a device scalar would sync the host
    with pytest.raises(InputError, match="together"):
        kernels.sparse_decode(**{**args, "extra_lengths": None})
    broken = make_pool(8, 136, 32, "fp8_e4m3", 16)
    broken.storage = broken.storage[:, :-8]
    with pytest.raises(InputError, match="kv.storage"):
        kernels.sparse_decode(**{**args, "kv": broken})
    q, w = args["q"], torch.randn(3, args["q"].shape[1], device=DEV)
    with pytest.raises(InputError, match="weights"):
        kernels.indexer_gather_scores(q, w[:, :1], args["kv"], args["indices"], 0.1)
    with pytest.raises(InputError, match="cand"):
        kernels.indexer_gather_scores(q, w, args["kv"], args["indices"][:1], 0.1)
