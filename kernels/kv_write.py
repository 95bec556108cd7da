"""A layer's K=V rows normed, roped and stored in one launch: the SWA pool write of a verify.

    kv_write(pool, slots, kv, weight, eps, cos, sin)
    # == pool.write(slots, rope(rms_norm(kv)))  (reference: ref_kv_write)

kv [T, head_dim] is kv_proj's output. One program per row: kv_norm (transformers'
DeepseekV4RMSNorm: weight * (x * r) in fp32, one rounding to kv's dtype) and RoPE on the trailing
rope channels, exactly as kernels/norm_rope.py (the same jit helpers: pairwise mean square,
correctly rounded sqrt and division, no multiply-add contraction), then the row's store:
* FP8 pools (kind "kv"): the row's record, byte-equal to the torch writer (serving/records.py:
  quantize_rows, then KVPool's byte scatter): per 64-value tile of the nope part the UE8M0 scale
  s = 2^ceil(log2(max(amax / 448, 1e-4))) (the ceil-log2 from the float32 bits), the e4m3 codes of
  x / s (exact: s is a power of two) rounded on the bits (kernels/fp8_store.py: _e4m3_code), the
  rope part as bfloat16 bits (_bf16_bits), the scale bytes zero-padded; page p holds its tokens'
  data records, then their scale records;
* other pools: the row in the storage's dtype at storage[slot] (bf16 by round-to-nearest-even).
Slots are the caller's guarantee (in range), as for KVPool.write. On the meta device the
launcher checks its inputs and launches nothing."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4_tree.errors import InputError

from ._launch import FLOATS, INDEX, check, check_device, pow2
from ._meta import on_meta
from ._rounding import round_to
from .fp8_store import _bf16_bits, _e4m3_code
from .norm_rope import ROW_DTYPES, _TL, _rms_norm_pairs, _rope_pairs, check_eps, check_rope_tables, pair_block

_STORE_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _fp8_record(v, p, col, live, data_at, scale_at, NOPE: tl.constexpr, TILE: tl.constexpr, N_TILES: tl.constexpr,
                SCALE_BYTES: tl.constexpr, TILES_P2: tl.constexpr, SCALE_P2: tl.constexpr):
    """Store row v [BP, 2] (fp32, col = 2p + j) as one KV record at data_at / scale_at."""
    nope = col < NOPE
    tile = (2 * p) // TILE  # a pair never straddles a tile (NOPE and TILE are even)
    pair_amax = tl.max(tl.where(nope, tl.abs(v), 0.0), axis=1)  # [BP]
    rt = tl.arange(0, TILES_P2)
    hit = rt[:, None] == tile[None, :]  # [TILES_P2, BP]
    amax = tl.max(tl.where(hit, pair_amax[None, :], 0.0), axis=1)
    ybits = tl.maximum(tl.div_rn(amax, 448.0), 1e-4).to(tl.uint32, bitcast=True)
    e = (ybits >> 23).to(tl.int32) - 127 + ((ybits & 0x7FFFFF) != 0).to(tl.int32)  # ceil(log2)
    inv = ((127 - e).to(tl.uint32) << 23).to(tl.float32, bitcast=True)  # 2^-e, exact
    pair_inv = tl.max(tl.where(hit, inv[:, None], 0.0), axis=0)  # [BP]: the pair's tile's 2^-e
    tl.store(data_at + col, _e4m3_code(v * pair_inv[:, None]), mask=nope)
    rope = live & (col >= NOPE)
    b = _bf16_bits(v)
    at = data_at + NOPE + 2 * (col - NOPE)
    tl.store(at, (b & 0xFF).to(tl.uint8), mask=rope)
    tl.store(at + 1, (b >> 8).to(tl.uint8), mask=rope)
    rs = tl.arange(0, SCALE_P2)
    e_at = tl.max(tl.where(rs[:, None] == rt[None, :], e[None, :] + 127, 0), axis=1)
    tl.store(scale_at + rs, tl.where(rs < N_TILES, e_at, 0).to(tl.uint8), mask=rs < SCALE_BYTES)


@triton.jit
def _kv_write_kernel(kv_ptr, w_ptr, cos_ptr, sin_ptr, slots_ptr, out_ptr, D, stride_kt, stride_ct, n, eps,
                     page_size, page_bytes,
                     FP8: tl.constexpr, NOPE_PAIRS: tl.constexpr, HALF: tl.constexpr, BP: tl.constexpr,
                     LOG_BP: tl.constexpr, ROW_DTYPE: tl.constexpr, STORE_DTYPE: tl.constexpr,
                     NOPE: tl.constexpr, DATA_BYTES: tl.constexpr, TILE: tl.constexpr, N_TILES: tl.constexpr,
                     SCALE_BYTES: tl.constexpr, TILES_P2: tl.constexpr, SCALE_P2: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    p = tl.arange(0, BP)
    col = 2 * p[:, None] + tl.arange(0, 2)[None, :]  # [BP, 2]
    live = col < D
    x = tl.load(kv_ptr + t * stride_kt + col, mask=live, other=0.0).to(tl.float32)
    x = _rms_norm_pairs(x, w_ptr, col, live, n, eps, 1, BP, LOG_BP, ROW_DTYPE)
    x = _rope_pairs(x, cos_ptr + t * stride_ct, sin_ptr + t * stride_ct, p, NOPE_PAIRS, HALF, False, ROW_DTYPE)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    if FP8:
        page = (slot // page_size) * page_bytes
        data_at = out_ptr + page + (slot % page_size) * DATA_BYTES
        scale_at = out_ptr + page + page_size * DATA_BYTES + (slot % page_size) * SCALE_BYTES
        _fp8_record(x, p, col, live, data_at, scale_at, NOPE, TILE, N_TILES, SCALE_BYTES, TILES_P2, SCALE_P2)
    else:
        tl.store(out_ptr + slot * D + col, round_to(x, STORE_DTYPE).to(STORE_DTYPE), mask=live)


def kv_write(pool, slots: torch.Tensor, kv: torch.Tensor, weight: torch.Tensor, eps, cos: torch.Tensor,
             sin: torch.Tensor) -> None:
    """pool: a KVPool of kind "kv" (any kv_cache_dtype); slots int [T]; kv [T, head_dim] fp32 / bf16
    (unit channel stride); weight [head_dim] (the kv_norm weight); eps a host float; cos, sin
    [T, pool.rope_dim / 2]. Stores rope(rms_norm(kv)) at the slots."""
    if getattr(pool, "kind", None) != "kv":
        raise InputError(f"kv_write stores K=V rows into a pool of kind 'kv', got {pool!r}")
    check("slots", slots, 1, INDEX)
    check("kv", kv, 2, ROW_DTYPES, contiguous=False)
    t, d = kv.shape
    if d != pool.head_dim or kv.stride(1) != 1:
        raise InputError(f"kv must be [T, {pool.head_dim}] with unit channel stride, got {tuple(kv.shape)} "
                         f"strides {kv.stride()}")
    if slots.shape[0] != t:
        raise InputError(f"slots must be [T={t}], got {tuple(slots.shape)}")
    check("weight", weight, 1, FLOATS)
    if weight.shape[0] != d:
        raise InputError(f"weight must be [head_dim={d}], got {tuple(weight.shape)}")
    check_eps(eps)
    half = check_rope_tables(cos, sin, t, d)
    if 2 * half != pool.rope_dim:
        raise InputError(f"cos / sin rotate {2 * half} channels, the pool's rows have rope_dim {pool.rope_dim}")
    tensors = (slots, kv, weight, cos, sin, pool.storage)
    if on_meta(*tensors):
        return
    check_device(*tensors)
    if t == 0:
        return
    bp, log_bp = pair_block(d)
    _kv_write_kernel[(t,)](
        kv, weight, cos, sin, slots, pool.storage, d, kv.stride(0), cos.stride(0), float(d), float(eps),
        pool.page_size, pool.page_bytes, FP8=pool.record is not None, NOPE_PAIRS=d // 2 - half, HALF=half, BP=bp,
        LOG_BP=log_bp, ROW_DTYPE=_TL[kv.dtype], STORE_DTYPE=_STORE_TL.get(pool.storage.dtype, tl.float32),
        **_record_args(pool.record), enable_fp_fusion=False)


def _record_args(rec) -> dict:
    """The KV record's layout as the kernel's constants (placeholders for an unquantised pool)."""
    if rec is None:
        return dict(NOPE=0, DATA_BYTES=1, TILE=2, N_TILES=1, SCALE_BYTES=1, TILES_P2=1, SCALE_P2=1)
    if rec.tile % 2:
        raise InputError(f"kv_write needs an even FP8 tile (channel pairs never straddle tiles), got {rec.tile}")
    return dict(NOPE=rec.nope_dim, DATA_BYTES=rec.data_bytes, TILE=rec.tile, N_TILES=rec.n_tiles,
                SCALE_BYTES=rec.scale_bytes, TILES_P2=pow2(rec.n_tiles, 1), SCALE_P2=pow2(rec.scale_bytes, 1))
