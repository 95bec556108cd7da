"""Reading rows of a paged KV pool inside a kernel: float rows, or FP8 records dequantised in-kernel.

A pool is described to the kernels by `PoolFormat` (built by the launcher from the pool's public
attributes: `storage`, `page_size`, `head_dim`, `kv_dtype`, `record`); the kernels never see the
pool object. Formats (constexpr `FMT`):
  0  float rows: storage [num_slots, head_dim] fp32 / bf16 / fp16 ("auto", "bfloat16");
  1  KV record:  per page all data records (nope e4m3 bytes, then rope bf16 little-endian), then all
     scale records (one e8m0 exponent byte per `tile` nope values); value = code * 2^(byte - 127);
  2  index-key record: all `head_dim` values e4m3, scale record one float32 per `tile` values.
e4m3 codes are decoded with integer ops (exact, no fp8 hardware needed): sign, 4-bit exponent
(bias 7; 0 = subnormal), 3-bit mantissa; NaN codes never occur (values are scaled into +-448).
Addresses are computed in int64 (a large FP8 pool exceeds 2^31 bytes)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dsv4_tree.errors import InputError

from ._launch import FLOATS
from ._dot import operand

FLOAT_ROWS, KV_RECORD, INDEX_KEY_RECORD = 0, 1, 2


@dataclass(frozen=True)
class PoolFormat:
    """How a kernel addresses one pool. For FLOAT_ROWS only `storage` and `fmt` matter."""

    storage: torch.Tensor  # [num_slots, head_dim] float, or uint8 [num_pages, page_bytes]
    fmt: int
    head_dim: int
    page_size: int = 1
    page_bytes: int = 0
    data_bytes: int = 0
    scale_bytes: int = 0
    fp8_dim: int = 0  # leading channels stored as e4m3 (the rest: bf16)
    tile: int = 1  # values per scale

    def kernel_args(self) -> tuple:
        return (self.storage, self.page_size, self.page_bytes, self.data_bytes, self.scale_bytes, self.fp8_dim, self.tile)


def bf16_rows(fmt: PoolFormat, one_scale: bool = False) -> bool:
    """Whether a kernel may feed the pool's rows to a bf16 dot without rounding them: bf16 rows,
    or V4 KV records (e4m3 code x 2^(byte - 127): at most 4 significant bits, exact in bf16). An
    index-key record's float32 scale is not assumed a power of two: with one_scale, a record
    whose one scale block covers the key qualifies (the dot takes the e4m3 codes, exact in bf16,
    and the caller applies the scale to the dot's result: `load_index_codes`)."""
    if fmt.fmt == FLOAT_ROWS:
        return fmt.storage.dtype == torch.bfloat16
    if fmt.fmt == KV_RECORD:
        return True
    return one_scale and fmt.tile >= fmt.head_dim


def pool_format(name: str, pool) -> PoolFormat:
    """Check a pool's public attributes and describe it to the kernels (InputError names `name`)."""
    for attr in ("storage", "page_size", "head_dim", "kv_dtype"):
        if not hasattr(pool, attr):
            raise InputError(f"{name} must be a KVPool (missing attribute {attr!r}), got {type(pool).__name__}")
    storage, d = pool.storage, pool.head_dim
    layout = getattr(pool, "record", None)
    if pool.kv_dtype != "fp8_e4m3":
        if storage.dim() != 2 or storage.shape[1] != d or storage.dtype not in FLOATS:
            raise InputError(f"{name}.storage must be float [num_slots, {d}], got {storage.dtype} {tuple(storage.shape)}")
        if not storage.is_contiguous():
            raise InputError(f"{name}.storage must be contiguous (strides {storage.stride()})")
        return PoolFormat(storage, FLOAT_ROWS, d)
    if layout is None:
        raise InputError(f"{name} has kv_dtype 'fp8_e4m3' but no record layout")
    ps = pool.page_size
    if hasattr(layout, "n_tiles"):  # DeepSeek-V4 KV record
        if layout.scale_bytes < layout.n_tiles or layout.data_bytes != layout.nope_dim + 2 * (d - layout.nope_dim):
            raise InputError(f"{name}.record is not a V4 KV record: {layout}")
        fmt = PoolFormat(storage, KV_RECORD, d, ps, layout.page_bytes(ps), layout.data_bytes, layout.scale_bytes,
                         layout.nope_dim, layout.tile)
    elif hasattr(layout, "block"):  # indexer-key record: e4m3 + one float32 scale per block
        if layout.data_bytes != d or layout.scale_bytes != 4 * -(-d // layout.block):
            raise InputError(f"{name}.record is not an indexer-key record of width {d}: {layout}")
        fmt = PoolFormat(storage, INDEX_KEY_RECORD, d, ps, layout.page_bytes(ps), layout.data_bytes,
                         layout.scale_bytes, d, layout.block)
    else:
        raise InputError(f"{name}.record {type(layout).__name__} is neither a KV record nor an indexer-key record")
    if storage.dtype != torch.uint8 or storage.dim() != 2 or storage.shape[1] != fmt.page_bytes:
        raise InputError(f"{name}.storage must be uint8 [num_pages, {fmt.page_bytes}], "
                         f"got {storage.dtype} {tuple(storage.shape)}")
    if not storage.is_contiguous():
        raise InputError(f"{name}.storage must be contiguous (strides {storage.stride()})")
    return fmt


@triton.jit
def _bytes_at(ptr, addr, mask):
    return tl.load(ptr + addr, mask=mask, other=0).to(tl.int32)


@triton.jit
def _e4m3_to_f32(code):
    """int32 codes in [0, 255] (e4m3fn bit patterns) -> fp32 values, exactly."""
    sign = tl.where((code & 0x80) != 0, -1.0, 1.0)
    e = (code >> 3) & 0xF
    m = code & 0x7
    normal = ((e + 120) << 23 | (m << 20)).to(tl.float32, bitcast=True)  # 2^(e-7) * (1 + m/8)
    subnormal = m.to(tl.float32) * 0.001953125  # m * 2^-9
    return sign * tl.where(e == 0, subnormal, normal)


@triton.jit
def load_pool_rows(ptr, slots, ok, rd, D, PAGE, PAGE_BYTES, DATA_BYTES, SCALE_BYTES, FP8_DIM, TILE,
                   FMT: tl.constexpr):
    """Rows `slots` (int, masked by ok) of a pool as an fp32 tile [R, BD]; masked lanes are 0."""
    s = tl.maximum(slots, 0).to(tl.int64)  # a select on ok here fails to compile under Triton 3.6; lane masks the loads
    lane = ok[:, None] & (rd[None, :] < D)
    if FMT == 0:
        rows = tl.load(ptr + s[:, None] * D + rd[None, :], mask=lane, other=0.0).to(tl.float32)
    else:
        rows = _load_records(ptr, s, lane, rd, PAGE, PAGE_BYTES, DATA_BYTES, SCALE_BYTES, FP8_DIM, TILE, FMT)
    return rows


@triton.jit
def _load_records(ptr, s, lane, rd, PAGE, PAGE_BYTES, DATA_BYTES, SCALE_BYTES, FP8_DIM, TILE,
                  FMT: tl.constexpr):
    page_base = (s // PAGE) * PAGE_BYTES
    off = s % PAGE
    data = (page_base + off * DATA_BYTES)[:, None]
    scale_rec = (page_base + PAGE * DATA_BYTES + off * SCALE_BYTES)[:, None]
    fp8_lane = lane & (rd[None, :] < FP8_DIM)
    code = _bytes_at(ptr, data + rd[None, :], fp8_lane)
    tile = (rd // TILE)[None, :]
    if FMT == 1:
        scale = (_bytes_at(ptr, scale_rec + tile, fp8_lane) << 23).to(tl.float32, bitcast=True)  # 2^(byte-127)
    else:
        at = scale_rec + tile * 4
        bits = (_bytes_at(ptr, at, fp8_lane) | (_bytes_at(ptr, at + 1, fp8_lane) << 8)
                | (_bytes_at(ptr, at + 2, fp8_lane) << 16) | (_bytes_at(ptr, at + 3, fp8_lane) << 24))
        scale = bits.to(tl.float32, bitcast=True)
    vals = tl.where(fp8_lane, _e4m3_to_f32(code) * scale, 0.0)
    bf_lane = lane & (rd[None, :] >= FP8_DIM)
    at = data + FP8_DIM + 2 * (rd[None, :] - FP8_DIM)
    bf = ((_bytes_at(ptr, at, bf_lane) | (_bytes_at(ptr, at + 1, bf_lane) << 8)) << 16).to(tl.float32, bitcast=True)
    return tl.where(bf_lane, bf, vals)


@triton.jit
def load_index_codes(ptr, slots, ok, rd, D, PAGE, PAGE_BYTES, DATA_BYTES, SCALE_BYTES):
    """Indexer-key records whose one float32 scale block covers the whole key (block >= D):
    the e4m3 values unscaled [R, BD] (exact in bf16) and each row's scale [R] (0 where not ok),
    so a dot can take the codes and apply the scale to its result: key . q = scale x (code . q)."""
    s = tl.where(ok, slots, 0).to(tl.int64)
    page_base = (s // PAGE) * PAGE_BYTES
    off = s % PAGE
    lane = ok[:, None] & (rd[None, :] < D)
    code = _bytes_at(ptr, (page_base + off * DATA_BYTES)[:, None] + rd[None, :], lane)
    at = page_base + PAGE * DATA_BYTES + off * SCALE_BYTES
    bits = (_bytes_at(ptr, at, ok) | (_bytes_at(ptr, at + 1, ok) << 8) | (_bytes_at(ptr, at + 2, ok) << 16)
            | (_bytes_at(ptr, at + 3, ok) << 24))
    return tl.where(lane, _e4m3_to_f32(code), 0.0), tl.where(ok, bits.to(tl.float32, bitcast=True), 0.0)


@triton.jit
def dot_keys(k_ptr, slot, ok, rd, D, PAGE, PAGE_BYTES, DATA_BYTES, SCALE_BYTES, FP8_DIM, TILE, FMT: tl.constexpr,
             MMA: tl.constexpr, CODES: tl.constexpr):
    """A key tile [BC, BD] as a dot operand (`_dot.operand`) and each key's factor [BC] for its
    dots: 1 (0 where not ok), or with CODES an FP8 index key's block scale (the dot takes the
    exact e4m3 values; the caller multiplies the dot by the factor)."""
    if CODES:
        keys, kscale = load_index_codes(k_ptr, slot, ok, rd, D, PAGE, PAGE_BYTES, DATA_BYTES, SCALE_BYTES)
    else:
        keys = load_pool_rows(k_ptr, slot, ok, rd, D, PAGE, PAGE_BYTES, DATA_BYTES, SCALE_BYTES, FP8_DIM, TILE, FMT)
        kscale = tl.where(ok, 1.0, 0.0)
    return operand(keys, MMA), kscale
