"""FP8 records quantised and stored in one launch: KVPool.write of an FP8 pool.

    fp8_store(pool, slots, rows)      # == pool.write(slots, rows) on the torch path

One program per row: the nope part's per-tile UE8M0 scales (s = 2^ceil(log2(max(amax / 448,
1e-4))), the ceil-log2 from the float32 bits), the e4m3 codes of x / s, the rope part as
bfloat16, written straight into the row's data and scale records at its slot's byte offsets
(serving/records.py has the layout; page p holds its tokens' data records, then their scale
records). An indexer-key pool's rows (kind "index_key"): every value e4m3 with one float32 scale
per 128-value block, s = 2^ceil(log2(max(amax, 1e-4) / 448)). The torch path
(serving/records.py: quantize_rows, then KVPool's byte scatter) is the reference; the records
are byte-equal.

Every rounding is integer arithmetic on the float32 bits, never a float -> fp8 / bf16 cast:
triton 3.9's interpreter gets both wrong (it truncates fp32 -> bf16, and its fp32 -> e4m3 cast
turns 1.9453 into 1.0 and 7.9 into 4.0, where round-to-nearest-even gives 2.0 and 8.0), and the
bit arithmetic is the same on a GPU. x / s is exact (s is a power of two), so the code is the
round-to-nearest-even e4m3 value of an exactly known float32 (|x / s| <= 448: no overflow)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4_tree.errors import InputError

from ._launch import FLOATS, check, check_device, pow2


@triton.jit
def _e4m3_code(v):
    """Round-to-nearest-even e4m3fn byte of float32 v (|v| <= 448), from the bits."""
    bits = v.to(tl.uint32, bitcast=True)
    sign = (bits >> 31) << 7
    mag = bits & 0x7FFFFFFF
    exp = (mag >> 23).to(tl.int32) - 127
    man = mag & 0x7FFFFF
    # normal e4m3 (exponent >= -6): keep 3 of the 23 mantissa bits
    keep = man >> 20
    rem = man & 0xFFFFF
    up = (rem > 0x80000) | ((rem == 0x80000) & ((keep & 1) == 1))
    normal = ((exp + 7).to(tl.uint32) << 3) + keep + up.to(tl.uint32)
    # subnormal e4m3 (|v| < 2^-6): multiples of 2^-9; RNE of |v| * 2^9 (exact) by the 2^23 trick
    a = mag.to(tl.float32, bitcast=True) * 512.0
    sub = ((a + 8388608.0) - 8388608.0).to(tl.uint32)
    code = tl.where(exp >= -6, normal, sub)
    return (sign | code).to(tl.uint8)


@triton.jit
def _bf16_bits(x):
    """Round-to-nearest-even bfloat16 bits of finite float32 x."""
    bits = x.to(tl.uint32, bitcast=True)
    return (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16


@triton.jit
def _fp8_store_kernel(rows_ptr, slots_ptr, out_ptr, stride_row, page_size, page_bytes,
                      NOPE: tl.constexpr, ROPE: tl.constexpr, TILE: tl.constexpr, N_TILES: tl.constexpr,
                      SCALE_BYTES: tl.constexpr, TILES_P2: tl.constexpr, ROPE_P2: tl.constexpr,
                      SCALE_P2: tl.constexpr):
    i = tl.program_id(0)
    slot = tl.load(slots_ptr + i)
    data_bytes = NOPE + 2 * ROPE
    page = (slot // page_size) * page_bytes
    data_at = out_ptr + page + (slot % page_size) * data_bytes
    scale_at = out_ptr + page + page_size * data_bytes + (slot % page_size) * SCALE_BYTES
    row = rows_ptr + i.to(tl.int64) * stride_row
    rt = tl.arange(0, TILES_P2)
    col = rt[:, None] * TILE + tl.arange(0, TILE)[None, :]
    live = col < NOPE
    x = tl.load(row + col, mask=live, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    y = tl.maximum(tl.div_rn(amax, 448.0), 1e-4)
    ybits = y.to(tl.uint32, bitcast=True)
    e = (ybits >> 23).to(tl.int32) - 127 + ((ybits & 0x7FFFFF) != 0).to(tl.int32)
    inv = ((127 - e).to(tl.uint32) << 23).to(tl.float32, bitcast=True)  # 2^-e, exact
    tl.store(data_at + col, _e4m3_code(x * inv[:, None]), mask=live)
    rk = tl.arange(0, ROPE_P2)
    rope = tl.load(row + NOPE + rk, mask=rk < ROPE, other=0.0).to(tl.float32)
    b = _bf16_bits(rope)
    tl.store(data_at + NOPE + 2 * rk, (b & 0xFF).to(tl.uint8), mask=rk < ROPE)
    tl.store(data_at + NOPE + 2 * rk + 1, (b >> 8).to(tl.uint8), mask=rk < ROPE)
    rs = tl.arange(0, SCALE_P2)
    e_at = tl.sum(tl.where(rs[:, None] == rt[None, :], e[None, :] + 127, 0), axis=1)
    tl.store(scale_at + rs, tl.where(rs < N_TILES, e_at, 0).to(tl.uint8), mask=rs < SCALE_BYTES)


@triton.jit
def _fp8_index_key_kernel(rows_ptr, slots_ptr, out_ptr, stride_row, page_size, page_bytes,
                          DIM: tl.constexpr, BLOCK: tl.constexpr, N_BLOCKS: tl.constexpr, BLOCKS_P2: tl.constexpr):
    i = tl.program_id(0)
    slot = tl.load(slots_ptr + i)
    page = (slot // page_size) * page_bytes
    data_at = out_ptr + page + (slot % page_size) * DIM
    scale_at = out_ptr + page + page_size * DIM + (slot % page_size) * (4 * N_BLOCKS)
    row = rows_ptr + i.to(tl.int64) * stride_row
    rb = tl.arange(0, BLOCKS_P2)
    col = rb[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    live = col < DIM
    x = tl.load(row + col, mask=live, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    y = tl.div_rn(tl.maximum(amax, 1e-4), 448.0)  # clamp, then divide (the indexer-key rule)
    ybits = y.to(tl.uint32, bitcast=True)
    e = (ybits >> 23).to(tl.int32) - 127 + ((ybits & 0x7FFFFF) != 0).to(tl.int32)
    inv = ((127 - e).to(tl.uint32) << 23).to(tl.float32, bitcast=True)  # 2^-e, exact
    tl.store(data_at + col, _e4m3_code(x * inv[:, None]), mask=live)
    sbits = (e + 127).to(tl.uint32) << 23  # the float32 2^e, little-endian bytes
    for k in tl.static_range(4):
        tl.store(scale_at + 4 * rb + k, ((sbits >> (8 * k)) & 0xFF).to(tl.uint8), mask=rb < N_BLOCKS)


def fp8_store(pool, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """pool: an FP8 KVPool (kv_cache_dtype "fp8_e4m3", kind "kv" or "index_key"); slots int64 [n]
    (in range: the caller's guarantee, as KVPool.write); rows [n, head_dim] float, finite."""
    if pool.record is None:
        raise InputError(f"fp8_store writes FP8 records, got {pool!r}")
    check_device(slots, rows, pool.storage)
    check("slots", slots, 1, (torch.int64,))
    check("rows", rows, 2, FLOATS, contiguous=False)
    if rows.shape != (slots.shape[0], pool.head_dim) or rows.stride(1) != 1:
        raise InputError(f"fp8_store needs rows [n, {pool.head_dim}] with unit channel stride for slots "
                         f"[n], got rows {tuple(rows.shape)} strides {rows.stride()}, slots {tuple(slots.shape)}")
    if slots.shape[0] == 0:
        return
    rec = pool.record
    if pool.kind == "index_key":
        _fp8_index_key_kernel[(slots.shape[0],)](
            rows, slots, pool.storage, rows.stride(0), pool.page_size, pool.page_bytes,
            DIM=rec.dim, BLOCK=rec.block, N_BLOCKS=rec.n_blocks, BLOCKS_P2=pow2(rec.n_blocks, 1))
        return
    _fp8_store_kernel[(slots.shape[0],)](
        rows, slots, pool.storage, rows.stride(0), pool.page_size, pool.page_bytes,
        NOPE=rec.nope_dim, ROPE=rec.rope_dim, TILE=rec.tile, N_TILES=rec.n_tiles, SCALE_BYTES=rec.scale_bytes,
        TILES_P2=pow2(rec.n_tiles, 1), ROPE_P2=pow2(max(rec.rope_dim, 1), 1), SCALE_P2=pow2(rec.scale_bytes, 1))
