"""KVPool: write/read/copy per storage dtype, the FP8 page layout, bad config, no host sync."""
from __future__ import annotations

import pytest
import torch

from dsv4_tree.diagnostics import forbid_host_sync
from dsv4_tree.errors import ConfigError, InputError, StateError
from dsv4_tree.serving import KV_CACHE_DTYPES, KVPool, dequantize_rows, quantize_rows

CASES = [  # (kv_dtype, compute_dtype)
    ("auto", torch.float32), ("auto", torch.bfloat16), ("bfloat16", torch.float32), ("fp8_e4m3", torch.float32),
    ("fp8_e4m3", torch.bfloat16),
]
KINDS = [("kv", 32, 8), ("kv", 512, 64), ("index_key", 16, 4)]


def make_pool(kv_dtype, compute_dtype, kind, head_dim, rope_dim, page_size, num_slots=600):
    return KVPool(num_slots, head_dim, rope_dim, kv_dtype, page_size, "cpu", compute_dtype, kind=kind)


def random_rows(n, head_dim, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, head_dim, generator=g) * torch.exp2(torch.empty(n, 1).uniform_(-6, 6, generator=g))


def expected_read(pool: KVPool, rows: torch.Tensor) -> torch.Tensor:
    if pool.kv_dtype == "auto":
        return rows.to(pool.compute_dtype)
    if pool.kv_dtype == "bfloat16":
        return rows.to(torch.bfloat16).to(pool.compute_dtype)
    return dequantize_rows(*quantize_rows(rows, pool.record), pool.record, pool.compute_dtype)


@pytest.mark.parametrize("page_size", [256, 16])
@pytest.mark.parametrize("kind,head_dim,rope_dim", KINDS)
@pytest.mark.parametrize("kv_dtype,compute_dtype", CASES)
def test_write_read_copy_bitwise(kv_dtype, compute_dtype, kind, head_dim, rope_dim, page_size):
    pool = make_pool(kv_dtype, compute_dtype, kind, head_dim, rope_dim, page_size)
    g = torch.Generator().manual_seed(page_size + head_dim)
    slots = torch.randperm(pool.num_slots, generator=g)[:100]
    rows = random_rows(100, head_dim, page_size).to(compute_dtype)
    pool.write(slots, rows)
    want = expected_read(pool, rows)
    got = pool.read(slots)
    assert got.dtype == compute_dtype and torch.equal(got, want), f"{kv_dtype=} {kind=} {page_size=}"
    # any index shape, -1 reads as zeros
    grid = torch.stack([slots[:7], torch.full((7,), -1)], dim=1)  # [7, 2]
    got2 = pool.read(grid)
    assert got2.shape == (7, 2, head_dim) and got2.is_contiguous()
    assert torch.equal(got2[:, 0], want[:7]) and (got2[:, 1] == 0).all()
    # reads are fresh tensors (read fills the -1 rows in place): never a view of the storage
    before = pool.record_bytes(slots)
    pool.read(grid).fill_(1.0)
    assert torch.equal(pool.record_bytes(slots), before)
    # record bytes: what the codec produces, or the raw storage dtype's bytes
    rec = pool.record_bytes(slots)
    assert rec.dtype == torch.uint8 and rec.shape == (100, pool.bytes_per_token)
    if pool.record is not None:
        assert torch.equal(rec, torch.cat(quantize_rows(rows, pool.record), dim=1))
    else:
        assert torch.equal(rec, want.to(pool.storage.dtype).contiguous().view(torch.uint8))
    # copy: slots[k] -> slots[30 + k] while slots[30 + k] -> a fresh slot, in one call: every read
    # must happen before any write
    everything = torch.arange(pool.num_slots)
    before, before_rows = pool.record_bytes(everything), pool.read(everything)
    fresh = everything[~torch.isin(everything, slots)][:30]
    src, dst = slots[:40], torch.cat([slots[30:40], fresh])
    pool.copy(src, dst)
    expected = before.clone()
    expected[dst] = before[src]
    assert torch.equal(pool.record_bytes(everything), expected), f"{kv_dtype=} {kind=} {page_size=}"
    assert torch.equal(pool.read(dst), before_rows[src])


@pytest.mark.parametrize("kind,head_dim,rope_dim", [("kv", 32, 8), ("index_key", 16, 0)])
def test_fp8_page_layout(kind, head_dim, rope_dim):
    """Page p = slots p*ps .. p*ps+ps-1: ps data records, then ps scale records, then zero padding."""
    ps = 16
    pool = make_pool("fp8_e4m3", torch.float32, kind, head_dim, rope_dim, ps, num_slots=3 * ps)
    lay = pool.record
    assert pool.storage.shape == (3, lay.page_bytes(ps))
    slots = torch.tensor([0, 5, ps - 1, ps, 2 * ps + 7])
    rows = random_rows(len(slots), head_dim, 1) + 1.0
    pool.write(slots, rows)
    data, scales = quantize_rows(rows, lay)
    for k, s in enumerate(slots.tolist()):
        page, off = pool.storage[s // ps], s % ps
        assert torch.equal(page[off * lay.data_bytes : (off + 1) * lay.data_bytes], data[k]), f"{s=}"
        sc = ps * lay.data_bytes + off * lay.scale_bytes
        assert torch.equal(page[sc : sc + lay.scale_bytes], scales[k]), f"{s=}"
    written = torch.zeros_like(pool.storage, dtype=torch.bool)
    for s in slots.tolist():
        off = s % ps
        written[s // ps, off * lay.data_bytes : (off + 1) * lay.data_bytes] = True
        sc = ps * lay.data_bytes + off * lay.scale_bytes
        written[s // ps, sc : sc + lay.scale_bytes] = True
    assert (pool.storage[~written] == 0).all(), "no byte outside the written records may change"
    if kind == "kv":
        assert lay.page_bytes(ps) > ps * lay.bytes_per_token, "this case must exercise page padding"


@pytest.mark.parametrize("kv_dtype", KV_CACHE_DTYPES)
def test_empty_calls_and_shape_errors(kv_dtype):
    pool = make_pool(kv_dtype, torch.float32, "kv", 32, 8, 16)
    none = torch.zeros(0, dtype=torch.int64)
    pool.write(none, torch.zeros(0, 32))
    pool.copy(none, none)
    assert pool.read(torch.zeros(0, 5, dtype=torch.int64)).shape == (0, 5, 32)
    assert pool.record_bytes(none).shape == (0, pool.bytes_per_token)
    assert (pool.storage == 0).all()
    with pytest.raises(InputError, match="rows"):
        pool.write(torch.tensor([1, 2]), torch.zeros(2, 31))
    with pytest.raises(InputError, match="copy"):
        pool.copy(torch.tensor([1, 2]), torch.tensor([3]))


def test_unknown_kv_dtype_names_value_and_choices():
    with pytest.raises(ConfigError) as err:
        KVPool(16, 32, 8, "fp8_e5m2", 16, "cpu", torch.float32)
    assert "fp8_e5m2" in str(err.value) and all(c in str(err.value) for c in KV_CACHE_DTYPES)
    with pytest.raises(ConfigError, match="kind"):
        KVPool(16, 32, 8, "auto", 16, "cpu", torch.float32, kind="c4")


def test_bytes_per_token():
    per = {(k, d, r): make_pool(k, torch.float32, "kv", d, r, 256).bytes_per_token
           for k in KV_CACHE_DTYPES for d, r in ((512, 64), (32, 8))}
    assert (per[("fp8_e4m3", 512, 64)], per[("bfloat16", 512, 64)], per[("auto", 512, 64)]) == (584, 1024, 2048)
    assert (per[("fp8_e4m3", 32, 8)], per[("bfloat16", 32, 8)], per[("auto", 32, 8)]) == (48, 64, 128)
    assert make_pool("fp8_e4m3", torch.float32, "index_key", 128, 0, 64).bytes_per_token == 132


@pytest.mark.parametrize("kv_dtype,compute_dtype", CASES)
def test_pool_methods_do_not_synchronise(kv_dtype, compute_dtype):
    pool = make_pool(kv_dtype, compute_dtype, "kv", 32, 8, 16)
    slots = torch.tensor([3, 17, 40])
    rows = random_rows(3, 32, 2).to(compute_dtype)
    with forbid_host_sync():
        pool.write(slots, rows)
        out = pool.read(torch.tensor([[3, -1], [40, 17]]))
        pool.copy(slots, torch.tensor([100, 101, 102]))
        rec = pool.record_bytes(torch.tensor([100, 101, 102]))
    assert torch.equal(out[1, 0], expected_read(pool, rows)[2]) and rec.shape == (3, pool.bytes_per_token)
    with pytest.raises(StateError, match="nonzero"), forbid_host_sync():
        slots.nonzero()  # the guard itself works
