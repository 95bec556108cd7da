"""A compressor's verify step as two launches: its kv / gate rows into the row pools, then one
kernel that turns every row's closed block into an entry and stores it into the entry pool.

    write_compressor_rows(pool, slots, kv, gate)   # == pool.write_rows(slots, kv, gate)
    compress_entries(pool, ct, module, cos, sin)   # == pool.entries.write(ct.entry_out, entries)
    compressor_write(pool, ct, module, slots, kv, gate, rope)   # both: AttentionOps.compressor_write

One program per row t of `compress_entries`:
* its R source rows by slot `ct.src[t]` straight from the row pools (a slot < 0 is the null row
  before position 0: kv 0, gate -inf); with C4's overlap (R = 2m) rows r < m give channels
  [0, d) (the previous block) and rows r >= m channels [d, 2d) (this block); the module's
  `position_bias[r % m]` is added to the gate in the dtype torch promotes the two to;
* per channel the softmax-weighted pool in fp32 (p = exp(g - max), sum(p kv) / sum(p): the
  pooling of `pool_entries`), rounded once to the model dtype;
* the module's kv_norm as transformers' RMSNorm computes it (fp32: x * rsqrt(mean(x^2) + eps),
  weight times that, one rounding; rsqrt as torch's CPU kernel, 1 / sqrt both correctly rounded,
  also on a GPU), then RoPE at the block start on the trailing rope pairs, as
  numerics/rope.py's full-width `apply_rope`: e*c + o*(-s), o*c + e*s in fp32 and x*1 + x'*0 on
  the nope channels, one rounding;
* the entry stored at slot `ct.entry_out[t]`: FP8 records quantised in the kernel (the rules and
  the bit arithmetic of kernels/fp8_store.py, byte-equal to the torch writer given the same
  entry), or the row in the pool's dtype. Rows that close no block pool the trash rows into the
  trash entry slot (static shapes, no host reads).
Every rounding to bf16 is integer arithmetic on the float32 bits (triton 3.9's interpreter
truncates that cast); launched without fp fusion, so each product and sum rounds as torch's.
Reference: dsv4_tree.reference.compress_entries.ref_compress_entries."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4_tree.errors import InputError

from ._launch import FLOATS, INDEX, check, check_device, pow2
from ._meta import on_meta
from ._version import COMPRESS_ROWS
from ._rounding import round_to
from .fp8_store import _bf16_bits, _e4m3_code

_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
PLAIN_F32, PLAIN_BF16, PLAIN_F16, FP8_KV, FP8_INDEX_KEY = range(5)  # how an entry is stored


@triton.jit
def _rows_copy_kernel(kv_ptr, gate_ptr, slots_ptr, rows_kv_ptr, rows_gate_ptr, stride_kv, stride_gate, W,
                      BW: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    cols = tl.arange(0, BW)
    for c0 in range(0, W, BW):
        c = c0 + cols
        m = c < W
        tl.store(rows_kv_ptr + slot * W + c, tl.load(kv_ptr + t * stride_kv + c, mask=m), mask=m)
        tl.store(rows_gate_ptr + slot * W + c, tl.load(gate_ptr + t * stride_gate + c, mask=m), mask=m)


def write_compressor_rows(pool, slots: torch.Tensor, kv: torch.Tensor, gate: torch.Tensor) -> None:
    """pool: CompressorPools; slots int [T] (in range: the caller's guarantee, as index_copy_);
    kv, gate [T, W] in the row pools' dtype, unit channel stride. Bit copies, one launch."""
    check("slots", slots, 1, INDEX)
    check("kv", kv, 2, FLOATS, contiguous=False)
    check("gate", gate, 2, FLOATS, contiguous=False)
    rows_kv, rows_gate = pool.rows_kv, pool.rows_gate
    t, w = slots.shape[0], rows_kv.shape[1]
    for name, x, rows in (("kv", kv, rows_kv), ("gate", gate, rows_gate)):
        if x.shape != (t, w) or x.stride(1) != 1 or x.dtype != rows.dtype:
            raise InputError(f"{name} must be [T={t}, {w}] {rows.dtype} with unit channel stride (the row pool's "
                             f"rows), got {tuple(x.shape)} {x.dtype} strides {x.stride()}")
    if not (rows_kv.is_contiguous() and rows_gate.is_contiguous()):
        raise InputError("the compressor's row pools must be contiguous")
    if on_meta(slots, kv, gate, rows_kv, rows_gate):
        return
    check_device(slots, kv, gate, rows_kv, rows_gate)
    if t == 0:
        return
    bits = _BITS[rows_kv.dtype]
    _rows_copy_kernel[(t,)](kv.view(bits), gate.view(bits), slots, rows_kv.view(bits), rows_gate.view(bits),
                            kv.stride(0), gate.stride(0), w, BW=min(pow2(w), 1024))


@triton.jit
def _source_tile(kv_ptr, gate_ptr, bias_ptr, src_row, r0, R, M, ch, live_ch, rr, D: tl.constexpr, W: tl.constexpr,
                 OVERLAP: tl.constexpr, GATE_DTYPE: tl.constexpr):
    """Rows r0 .. r0 + BR of the block: (gate + bias, kv) [BR, BP, 2] fp32; -inf gates where no row."""
    r = r0 + rr
    in_r = r < R
    slot = tl.load(src_row + r, mask=in_r, other=-1).to(tl.int64)
    ok = (in_r & (slot >= 0))[:, None, None] & live_ch[None, :, :]
    if OVERLAP:
        half = r // M  # 0: the previous block's first channels, 1: this block's last channels
    else:
        half = r * 0
    col = (half * D)[:, None, None] + ch[None, :, :]
    at = slot[:, None, None] * W + col
    g = tl.load(gate_ptr + at, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(bias_ptr + (r - half * M)[:, None, None] * W + col, mask=ok, other=0.0).to(tl.float32)
    g = tl.where(ok, round_to(g + b, GATE_DTYPE), float("-inf"))
    g = tl.where(live_ch[None, :, :], g, 0.0)  # padding channels: finite, their kv is 0
    kv = tl.load(kv_ptr + at, mask=ok, other=0.0).to(tl.float32)
    return g, kv


@triton.jit
def _compress_entries_kernel(kv_ptr, gate_ptr, bias_ptr, w_ptr, cos_ptr, sin_ptr, src_ptr, slot_ptr, out_ptr,
                             R, M, stride_src, stride_cos, stride_sin, eps, page_size, page_bytes,
                             D: tl.constexpr, W: tl.constexpr, HALF: tl.constexpr, OVERLAP: tl.constexpr,
                             BR: tl.constexpr, BP: tl.constexpr, DTYPE: tl.constexpr, GATE_DTYPE: tl.constexpr,
                             STORE: tl.constexpr, NOPE: tl.constexpr, TILE: tl.constexpr, N_TILES: tl.constexpr,
                             SCALE_BYTES: tl.constexpr, TILES_P2: tl.constexpr, SCALE_P2: tl.constexpr):
    t = tl.program_id(0)
    j = tl.arange(0, BP)  # channel pairs (2j, 2j + 1)
    ch = 2 * j[:, None] + tl.arange(0, 2)[None, :]  # [BP, 2]
    live_ch = ch < D
    rr = tl.arange(0, BR)
    src_row = src_ptr + t.to(tl.int64) * stride_src
    # the pooling: per channel max, then sum(p kv) / sum(p), fp32
    gmax = tl.full((BP, 2), float("-inf"), tl.float32)
    for r0 in range(0, R, BR):
        g, kv = _source_tile(kv_ptr, gate_ptr, bias_ptr, src_row, r0, R, M, ch, live_ch, rr, D, W, OVERLAP,
                             GATE_DTYPE)
        gmax = tl.maximum(gmax, tl.max(g, axis=0))
    gmax = tl.where(gmax == float("-inf"), 0.0, gmax)  # a channel without rows: weights 0, kept finite
    num = tl.zeros((BP, 2), tl.float32)
    den = tl.zeros((BP, 2), tl.float32)
    for r0 in range(0, R, BR):
        g, kv = _source_tile(kv_ptr, gate_ptr, bias_ptr, src_row, r0, R, M, ch, live_ch, rr, D, W, OVERLAP,
                             GATE_DTYPE)
        p = tl.exp(g - gmax[None, :, :])
        num += tl.sum(p * kv, axis=0)
        den += tl.sum(p, axis=0)
    x = round_to(tl.div_rn(num, tl.where(den > 0, den, 1.0)), DTYPE)  # the pooled entry, model dtype
    # kv_norm: transformers' RMSNorm (fp32 inside, weight times the normed row, one rounding)
    var = tl.div_rn(tl.sum(tl.sum(x * x, axis=1), axis=0), D * 1.0)
    w = tl.load(w_ptr + ch, mask=live_ch, other=0.0).to(tl.float32)
    rstd = tl.div_rn(1.0, tl.sqrt_rn(var + eps))  # torch's CPU rsqrt: 1 / sqrt, each correctly rounded
    y = round_to(w * (x * rstd), DTYPE)
    # RoPE at the block start on the trailing HALF pairs (full-width tables: c = 1, s = 0 elsewhere)
    rope = j - (D // 2 - HALF)
    on = (rope >= 0) & (j < D // 2)
    c = tl.load(cos_ptr + t * stride_cos + rope, mask=on, other=1.0).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_sin + rope, mask=on, other=0.0).to(tl.float32)
    s_even = tl.where(on, -s, 0.0)
    ye, yo = tl.split(y)
    e = round_to(ye * c + yo * s_even, DTYPE)
    o = round_to(yo * c + ye * s, DTYPE)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if STORE == 0:  # PLAIN_F32
        _store_pairs(out_ptr + slot * D, j, e, o, D // 2)
    elif STORE == 1:  # PLAIN_BF16: the row's bf16 bits into the storage viewed as int16
        _store_pairs(out_ptr + slot * D, j, _bf16_bits(e).to(tl.uint16).to(tl.int16, bitcast=True),
                     _bf16_bits(o).to(tl.uint16).to(tl.int16, bitcast=True), D // 2)
    elif STORE == 2:  # PLAIN_F16 (values already fp16)
        _store_pairs(out_ptr + slot * D, j, e.to(tl.float16), o.to(tl.float16), D // 2)
    else:
        _store_record(out_ptr, slot, page_size, page_bytes, j, e, o, D, STORE, NOPE, TILE, N_TILES, SCALE_BYTES,
                      TILES_P2, SCALE_P2)


@triton.jit
def _store_pairs(row_ptr, j, e, o, PAIRS):
    tl.store(row_ptr + 2 * j, e, mask=j < PAIRS)
    tl.store(row_ptr + 2 * j + 1, o, mask=j < PAIRS)


@triton.jit
def _tile_scales(j, e, o, NOPE, TILE: tl.constexpr, TILES_P2: tl.constexpr, INDEX_KEY: tl.constexpr):
    """Per tile of the quantised channels: its exponent and 2^-exponent ([TILES_P2]); and each
    pair's 2^-exponent ([BP]). The amax / 448, 1e-4 floor and ceil-log2 rules of fp8_store."""
    nope = 2 * j < NOPE
    a = tl.where(nope, tl.maximum(tl.abs(e), tl.abs(o)), 0.0)
    tiles = tl.arange(0, TILES_P2)
    mine = (2 * j)[None, :] // TILE == tiles[:, None]  # [TILES_P2, BP]
    amax = tl.max(tl.where(mine, a[None, :], 0.0), axis=1)
    if INDEX_KEY:
        y = tl.div_rn(tl.maximum(amax, 1e-4), 448.0)
    else:
        y = tl.maximum(tl.div_rn(amax, 448.0), 1e-4)
    ybits = y.to(tl.uint32, bitcast=True)
    ex = (ybits >> 23).to(tl.int32) - 127 + ((ybits & 0x7FFFFF) != 0).to(tl.int32)
    inv = ((127 - ex).to(tl.uint32) << 23).to(tl.float32, bitcast=True)  # 2^-ex, exact
    inv_j = tl.sum(tl.where(mine, inv[:, None], 0.0), axis=0)
    return ex, inv_j, tiles


@triton.jit
def _store_record(out_ptr, slot, page_size, page_bytes, j, e, o, D, STORE: tl.constexpr, NOPE: tl.constexpr,
                  TILE: tl.constexpr, N_TILES: tl.constexpr, SCALE_BYTES: tl.constexpr, TILES_P2: tl.constexpr,
                  SCALE_P2: tl.constexpr):
    """One FP8 record (serving/records.py layouts): kind "kv" (NOPE e4m3 channels in TILE-wide
    ue8m0 tiles, then the rope channels as bf16) or "index_key" (all D channels e4m3, float32
    block scales; TILE = the block)."""
    data_bytes = NOPE + 2 * (D - NOPE)
    page = (slot // page_size) * page_bytes
    data_at = out_ptr + page + (slot % page_size) * data_bytes
    scale_at = out_ptr + page + page_size * data_bytes + (slot % page_size) * SCALE_BYTES
    ex, inv, tiles = _tile_scales(j, e, o, NOPE, TILE, TILES_P2, STORE == 4)
    nope = 2 * j < NOPE
    tl.store(data_at + 2 * j, _e4m3_code(e * inv), mask=nope)
    tl.store(data_at + 2 * j + 1, _e4m3_code(o * inv), mask=nope)
    if STORE == 4:  # FP8_INDEX_KEY: one little-endian float32 2^ex per block
        sbits = (ex + 127).to(tl.uint32) << 23
        for k in tl.static_range(4):
            tl.store(scale_at + 4 * tiles + k, ((sbits >> (8 * k)) & 0xFF).to(tl.uint8), mask=tiles < N_TILES)
    else:  # FP8_KV: the rope channels as bf16 bytes, then one ue8m0 byte per tile, zero padding
        rope = (2 * j >= NOPE) & (2 * j < D)
        at = data_at + NOPE + 2 * (2 * j - NOPE)  # little-endian bf16 of channel 2j, then of 2j + 1
        be, bo = _bf16_bits(e), _bf16_bits(o)
        tl.store(at, (be & 0xFF).to(tl.uint8), mask=rope)
        tl.store(at + 1, (be >> 8).to(tl.uint8), mask=rope)
        tl.store(at + 2, (bo & 0xFF).to(tl.uint8), mask=rope)
        tl.store(at + 3, (bo >> 8).to(tl.uint8), mask=rope)
        rs = tl.arange(0, SCALE_P2)
        e_at = tl.sum(tl.where(rs[:, None] == tiles[None, :], ex[None, :] + 127, 0), axis=1)
        tl.store(scale_at + rs, tl.where(rs < N_TILES, e_at, 0).to(tl.uint8), mask=rs < SCALE_BYTES)


def _store_kind(entries) -> tuple:
    """(STORE, NOPE, TILE, N_TILES, SCALE_BYTES, page_size, page_bytes, storage) of an entry pool."""
    rec = entries.record
    if rec is None:
        kind = {torch.float32: PLAIN_F32, torch.bfloat16: PLAIN_BF16, torch.float16: PLAIN_F16}[entries.storage.dtype]
        storage = entries.storage.view(torch.int16) if kind == PLAIN_BF16 else entries.storage
        return kind, entries.head_dim, 2, 1, 1, 1, 1, storage
    if entries.kind == "index_key":
        if rec.block % 2:
            raise InputError(f"pool.entries: an indexer-key block of {rec.block} values splits a channel pair")
        return FP8_INDEX_KEY, rec.dim, rec.block, rec.n_blocks, rec.scale_bytes, entries.page_size, \
            entries.page_bytes, entries.storage
    if rec.tile % 2 or rec.nope_dim % 2:
        raise InputError(f"pool.entries: a record with nope_dim {rec.nope_dim} / tile {rec.tile} splits a channel pair")
    return FP8_KV, rec.nope_dim, rec.tile, rec.n_tiles, rec.scale_bytes, entries.page_size, entries.page_bytes, \
        entries.storage


def compress_entries(pool, ct, module, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Every row's entry into pool.entries at ct.entry_out (see the module docstring).

    pool: CompressorPools (rows_kv / rows_gate [S, W], W = 2d with overlap, else d; entries: a
          KVPool of head_dim d); ct: the ratio's CompressTables (src [T, R], R = 2m with overlap,
          else m; entry_out [T]); module: the compressor (position_bias [m, W], kv_norm);
    cos, sin: [T, half] at each row's block start (RowRope.pair(ratio)), rope on the last 2 half
          channels."""
    m, d, overlap = pool.ratio, pool.head_dim, pool.overlap
    rows_kv, rows_gate, entries = pool.rows_kv, pool.rows_gate, pool.entries
    w_rows, r_rows = (2 * d, 2 * m) if overlap else (d, m)
    if ct.ratio != m:
        raise InputError(f"ct.ratio {ct.ratio} is not the compressor's ratio {m}")
    for name, x in (("pool.rows_kv", rows_kv), ("pool.rows_gate", rows_gate)):
        check(name, x, 2, FLOATS)
        if x.shape[1] != w_rows or x.dtype != rows_kv.dtype:
            raise InputError(f"{name} must be [slots, {w_rows}] {rows_kv.dtype}, got {tuple(x.shape)} {x.dtype}")
    check("ct.src", ct.src, 2, INDEX, contiguous=False)
    t = ct.src.shape[0]
    if ct.src.shape[1] != r_rows or ct.src.stride(1) != 1:
        raise InputError(f"ct.src must be [T, {r_rows}] with unit stride along the rows, got {tuple(ct.src.shape)} "
                         f"strides {ct.src.stride()}")
    check("ct.entry_out", ct.entry_out, 1, INDEX)
    if ct.entry_out.shape[0] != t:
        raise InputError(f"ct.entry_out must be [T={t}], got {tuple(ct.entry_out.shape)}")
    bias, norm = module.position_bias.detach(), module.kv_norm
    weight = norm.weight.detach()
    check("module.position_bias", bias, 2, FLOATS)
    if tuple(bias.shape) != (m, w_rows):
        raise InputError(f"module.position_bias must be [{m}, {w_rows}], got {tuple(bias.shape)}")
    check("module.kv_norm.weight", weight, 1, FLOATS)
    if weight.shape[0] != d or d % 2:
        raise InputError(f"module.kv_norm.weight must be [head_dim={d}] (even), got {tuple(weight.shape)}")
    for name, x in (("cos", cos), ("sin", sin)):
        check(name, x, 2, FLOATS, contiguous=False)
        if x.shape != cos.shape or x.shape[0] != t or x.stride(1) != 1 or not 0 < 2 * x.shape[1] <= d:
            raise InputError(f"{name} must be [T={t}, half] with 0 < 2 half <= {d} and unit stride (cos "
                             f"{tuple(cos.shape)}), got {tuple(x.shape)} strides {x.stride()}")
    if entries.head_dim != d:
        raise InputError(f"pool.entries has head_dim {entries.head_dim}, the compressor {d}")
    store, nope, tile, n_tiles, scale_bytes, page_size, page_bytes, out = _store_kind(entries)
    tensors = (rows_kv, rows_gate, ct.src, ct.entry_out, bias, weight, cos, sin, entries.storage)
    if on_meta(*tensors):
        return
    check_device(*tensors)
    if t == 0:
        return
    # gate + bias rounds to the dtype torch promotes the two to (two float dtypes: their own if equal, else fp32)
    gate_dtype = rows_gate.dtype if rows_gate.dtype == bias.dtype else torch.float32
    _compress_entries_kernel[(t,)](
        rows_kv, rows_gate, bias, weight, cos, sin, ct.src, ct.entry_out, out,
        r_rows, m, ct.src.stride(0), cos.stride(0), sin.stride(0), norm.variance_epsilon, page_size, page_bytes,
        D=d, W=w_rows, HALF=cos.shape[1], OVERLAP=overlap, BR=min(pow2(r_rows, 2), COMPRESS_ROWS), BP=pow2(d // 2, 1),
        DTYPE=_TL[rows_kv.dtype], GATE_DTYPE=_TL[gate_dtype], STORE=store, NOPE=nope, TILE=tile,
        N_TILES=n_tiles, SCALE_BYTES=scale_bytes, TILES_P2=pow2(n_tiles, 1), SCALE_P2=pow2(scale_bytes, 1),
        enable_fp_fusion=False)


def compressor_write(pool, ct, module, slots: torch.Tensor, kv: torch.Tensor, gate: torch.Tensor, rope) -> None:
    """AttentionOps.compressor_write of the Triton backend: the rows (one launch), then every row's
    entry (one launch; it reads this step's rows, so it runs after them). rope: the step's RowRope."""
    write_compressor_rows(pool, slots, kv, gate)
    cos, sin = rope.pair(ct.ratio)
    compress_entries(pool, ct, module, cos, sin)
