"""kernels.fp8_store (one launch per write) stores FP8 records (K=V rows and entries, indexer
keys) byte-equal to the torch writer (KVPool.write: serving/records.py quantize_rows, then the
byte scatter)."""
import pytest
import torch

import dsv4_tree as dt
from dsv4_tree import kernels
from dsv4_tree.diagnostics import LaunchCounter
from dsv4_tree.serving.kv_pool import KVPool


def hard_rows(n: int, d: int, gen: torch.Generator) -> torch.Tensor:
    """Random rows with the cases a quantiser gets wrong planted in them: the values triton's
    interpreter casts wrongly (1.9453 -> 1.0 and 7.9 -> 4.0 where round-to-nearest-even gives 2.0
    and 8.0: the kernel never casts to fp8, so these must come out right), e4m3 halfway points
    (ties to even), subnormal codes, signed zeros, a tile amax of exactly 448 x a power of two,
    and rows spanning 1e-6 to 1e3."""
    rows = torch.randn(n, d, generator=gen) * torch.logspace(-6, 3, n).unsqueeze(1)
    rows[0, :4] = torch.tensor([1.9453, 7.9, -1.9453, -7.9]) * 2.0 ** -3  # scaled by s = 2^0 after amax 448 below
    rows[0, 4] = 448.0 * 2.0 ** -3
    rows[1, :6] = torch.tensor([1.0625, 1.1875, 2.125, -2.375, 0.0, -0.0])  # halfway: even codes win
    rows[1, 6] = 448.0  # amax = 448 x 2^0: s = 1 exactly
    rows[2, :3] = torch.tensor([2.0 ** -10, 3 * 2.0 ** -10, 5 * 2.0 ** -11])  # subnormal e4m3 codes / halfway
    rows[2, 3] = 1.0  # s = 2^-8 (amax / 448 < 2^-8): the small values land in the subnormal range
    rows[3] = 0.0  # the scale floor 1e-4
    return rows


@pytest.mark.parametrize("d,rope,page_size,dtype", [(32, 8, 16, torch.float32), (32, 8, 4, torch.bfloat16),
                                                    (512, 64, 16, torch.bfloat16), (136, 8, 64, torch.float32)])
def test_fp8_store_records_byte_equal_to_the_torch_writer(d, rope, page_size, dtype):
    gen = torch.Generator().manual_seed(d + page_size)
    n, slots_total = 24, 96
    want = KVPool(slots_total, d, rope, "fp8_e4m3", page_size, "cpu", dtype)
    got = KVPool(slots_total, d, rope, "fp8_e4m3", page_size, "cpu", dtype)
    noise = torch.randint(0, 256, want.storage.shape, generator=gen, dtype=torch.uint8)
    want.storage.copy_(noise)  # bytes no write touches must stay as they were
    got.storage.copy_(noise)
    slots = torch.randperm(slots_total, generator=gen)[:n]
    rows = hard_rows(n, d, gen).to(dtype)
    want.write(slots, rows)
    with LaunchCounter() as launches:
        kernels.fp8_store(got, slots, rows)
    assert launches.by_name == {"triton._fp8_store_kernel": 1}, dict(launches.by_name)
    bad = (got.storage != want.storage).nonzero().tolist()
    assert not bad, f"{d=} {rope=} {page_size=} {dtype=}: {len(bad)} bytes differ, first (page, byte) {bad[:4]}"


@pytest.mark.parametrize("d,page_size", [(32, 16), (200, 4), (128, 64)])
def test_fp8_store_index_keys_byte_equal_to_the_torch_writer(d, page_size):
    gen = torch.Generator().manual_seed(d)
    want = KVPool(96, d, 0, "fp8_e4m3", page_size, "cpu", torch.bfloat16, kind="index_key")
    got = KVPool(96, d, 0, "fp8_e4m3", page_size, "cpu", torch.bfloat16, kind="index_key")
    noise = torch.randint(0, 256, want.storage.shape, generator=gen, dtype=torch.uint8)
    want.storage.copy_(noise)
    got.storage.copy_(noise)
    slots = torch.randperm(96, generator=gen)[:24]
    rows = hard_rows(24, d, gen).to(torch.bfloat16)
    want.write(slots, rows)
    kernels.fp8_store(got, slots, rows)
    bad = (got.storage != want.storage).nonzero().tolist()
    assert not bad, f"{d=} {page_size=}: {len(bad)} bytes differ, first (page, byte) {bad[:4]}"


def test_fp8_store_checks_its_arguments():
    pool = KVPool(8, 32, 8, "fp8_e4m3", 4, "cpu", torch.float32)
    rows, slots = torch.zeros(2, 32), torch.tensor([0, 1])
    with pytest.raises(dt.InputError, match="rows"):
        kernels.fp8_store(pool, slots, torch.zeros(2, 16))
    with pytest.raises(dt.InputError, match="dtype"):
        kernels.fp8_store(pool, slots.int(), rows)
    with pytest.raises(dt.InputError, match="FP8 records"):
        kernels.fp8_store(KVPool(8, 32, 8, "auto", 4, "cpu", torch.float32), slots, rows)


def test_triton_engine_stores_its_fp8_records_through_the_kernel():
    """The wiring the slow test below checks end to end: a Triton engine's FP8 pools (SWA and
    compressed entries) write through the kernel, a torch engine's through the torch writer."""
    from cases import small_model

    model = small_model()
    for backend, kernel in (("triton", True), ("torch", False)):
        eng = dt.Engine(model, dt.SpecConfig(eagle_topk=4, num_steps=8, num_draft_tokens=16, page_size=16,
                                             kv_cache_dtype="fp8_e4m3", attention_backend=backend))
        pools = [pool for lp in eng.runtime.pools for pool in (lp.swa, *(c.entries for c in lp.compressors))]
        kv_pools = [pool for pool in pools if pool.record is not None]
        assert len({p.kind for p in kv_pools}) == 2, backend
        assert all((pool._store is not None) == kernel for pool in kv_pools), backend


# slow (nightly, docs/testing.md): every pool byte of an interpreted Triton engine against the torch writer's; the
# kernel's bytes against the torch writer's and the engine's wiring stay in every run (above)
@pytest.mark.slow
def test_triton_engine_writes_its_fp8_pools_through_the_kernel_bitwise_as_the_torch_writer():
    """The same triton engine twice, one with the torch writer put back: every pool byte and
    every logit after a prefill and a verify (C4 and C128 blocks close) is the same."""
    from cases import prompt, random_tree, small_model

    model = small_model()
    p = prompt(18, 2)
    results = []
    for kernel_writes in (True, False):
        eng = dt.Engine(model, dt.SpecConfig(eagle_topk=4, num_steps=8, num_draft_tokens=16, page_size=16,
                                             kv_cache_dtype="fp8_e4m3", attention_backend="triton"))
        pools = [pool for lp in eng.runtime.pools for pool in (lp.swa, *(c.entries for c in lp.compressors))]
        kv_pools = [pool for pool in pools if pool.record is not None]
        assert all(pool._store is not None for pool in kv_pools) and len({p.kind for p in kv_pools}) == 2
        if not kernel_writes:
            for pool in kv_pools:
                pool._store = None
        req = eng.prefill(p)
        out = eng.verify([req], [random_tree(req.root_token, 12, 5, 3, 1)])
        results.append(([pool.storage.clone() for pool in pools], out.logits[0].clone()))
    (got, got_logits), (want, want_logits) = results
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"pool {i}: {int((g != w).sum())} bytes differ"
    assert torch.equal(got_logits, want_logits)
