"""TEST-ONLY stand-in for `dsv4_tree.serving.kv_pool.KVPool` (same public API and byte layout).

The sparse-decode / indexer-gather tests need paged pools before the serving package lands;
this file implements just the documented surface: `storage`, `num_slots`, `head_dim`,
`rope_dim`, `page_size`, `kv_dtype`, `compute_dtype`, `layout` (None unless FP8),
`bytes_per_token`, `write`, `read`, `copy`, `record_bytes`. Tests build pools only through
`make_pool` in tests/test_sparse_decode.py, so switching to the real pool is one line.

FP8 "kv" record (DeepSeek-V4 / FlashMLA MODEL1_FP8Sparse): channels [nope | rope]; per token a
data record of nope_dim e4m3 bytes then rope_dim bf16 values, and a scale record of one e8m0
exponent byte per 64-value nope tile, padded to a multiple of 8 bytes; a page holds all data
records, then all scale records, padded to a multiple of data_bytes. FP8 "index_key" record:
dim e4m3 bytes + one float32 scale per 128 values, same per-page split, no padding.
Scale per tile/block: the power of two 2^ceil(log2(max(amax / 448, 1e-4))) (FlashMLA's rule)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dsv4_tree.errors import ConfigError

E4M3_MAX = 448.0


def _ceil_to(a: int, b: int) -> int:
    return -(-a // b) * b


@dataclass(frozen=True)
class StandinRecordLayout:
    head_dim: int
    rope_dim: int
    tile: int = 64

    @property
    def nope_dim(self) -> int:
        return self.head_dim - self.rope_dim

    @property
    def n_tiles(self) -> int:
        return math.ceil(self.nope_dim / self.tile)

    @property
    def data_bytes(self) -> int:
        return self.nope_dim + 2 * self.rope_dim

    @property
    def scale_bytes(self) -> int:
        return _ceil_to(self.n_tiles, 8)

    @property
    def bytes_per_token(self) -> int:
        return self.data_bytes + self.scale_bytes

    def page_bytes(self, page_size: int) -> int:
        return _ceil_to(page_size * self.bytes_per_token, self.data_bytes)


@dataclass(frozen=True)
class StandinIndexKeyLayout:
    dim: int
    block: int = 128

    @property
    def n_blocks(self) -> int:
        return math.ceil(self.dim / self.block)

    @property
    def data_bytes(self) -> int:
        return self.dim

    @property
    def scale_bytes(self) -> int:
        return 4 * self.n_blocks

    @property
    def bytes_per_token(self) -> int:
        return self.data_bytes + self.scale_bytes

    def page_bytes(self, page_size: int) -> int:
        return page_size * self.bytes_per_token


def _pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """Exact exponent e = ceil(log2(max(amax / 448, 1e-4))) as int32 (frexp: x = m 2^k, m in [0.5, 1))."""
    mant, k = torch.frexp(torch.clamp_min(amax / E4M3_MAX, 1e-4))
    return torch.where(mant == 0.5, k - 1, k).to(torch.int32)


def _blocks(x: torch.Tensor, width: int, block: int) -> torch.Tensor:
    n = x.shape[0]
    return torch.nn.functional.pad(x, (0, _ceil_to(width, block) - width)).view(n, -(-width // block), block)


def _encode(rows: torch.Tensor, layout) -> tuple[torch.Tensor, torch.Tensor]:
    x = rows.float()
    n = x.shape[0]
    fp8_width = layout.nope_dim if isinstance(layout, StandinRecordLayout) else layout.dim
    block = layout.tile if isinstance(layout, StandinRecordLayout) else layout.block
    tiles = _blocks(x[:, :fp8_width], fp8_width, block)
    exp = _pow2_scale(tiles.abs().amax(-1))  # [n, tiles]
    codes = (tiles * torch.exp2(-exp.float()).unsqueeze(-1)).to(torch.float8_e4m3fn)
    codes = codes.view(torch.uint8).view(n, -1)[:, :fp8_width]
    if isinstance(layout, StandinRecordLayout):
        rope = x[:, fp8_width:].to(torch.bfloat16).view(torch.uint8)
        scales = torch.zeros(n, layout.scale_bytes, dtype=torch.uint8, device=x.device)
        scales[:, : exp.shape[1]] = (exp + 127).to(torch.uint8)
        return torch.cat([codes, rope], 1), scales
    return codes, torch.exp2(exp.float()).view(torch.uint8).reshape(n, -1)


def _decode(data: torch.Tensor, scales: torch.Tensor, layout, dtype) -> torch.Tensor:
    n = data.shape[0]
    record = isinstance(layout, StandinRecordLayout)
    fp8_width = layout.nope_dim if record else layout.dim
    block = layout.tile if record else layout.block
    vals = data[:, :fp8_width].contiguous().view(torch.float8_e4m3fn).float()
    if record:
        scale = torch.exp2(scales[:, : layout.n_tiles].float() - 127)
    else:
        scale = scales.contiguous().view(torch.float32)
    vals = (_blocks(vals, fp8_width, block) * scale.unsqueeze(-1)).view(n, -1)[:, :fp8_width]
    if record:
        vals = torch.cat([vals, data[:, fp8_width:].contiguous().view(torch.bfloat16).float()], 1)
    return vals.to(dtype)


class StandinKVPool:
    def __init__(self, num_slots: int, head_dim: int, rope_dim: int, kv_dtype: str, page_size: int,
                 device, compute_dtype: torch.dtype, kind: str = "kv"):
        if kv_dtype not in ("auto", "bfloat16", "fp8_e4m3"):
            raise ConfigError(f"kv_cache_dtype={kv_dtype!r} is not one of auto, bfloat16, fp8_e4m3")
        self.num_slots, self.head_dim, self.rope_dim = num_slots, head_dim, rope_dim
        self.kv_dtype, self.page_size, self.compute_dtype, self.kind = kv_dtype, page_size, compute_dtype, kind
        self.layout = None
        if kv_dtype == "fp8_e4m3":
            self.layout = (StandinRecordLayout(head_dim, rope_dim) if kind == "kv"
                           else StandinIndexKeyLayout(head_dim))
            pages = -(-num_slots // page_size)
            self.storage = torch.zeros(pages, self.layout.page_bytes(page_size), dtype=torch.uint8, device=device)
            self.bytes_per_token = self.layout.bytes_per_token
        else:
            dtype = compute_dtype if kv_dtype == "auto" else torch.bfloat16
            self.storage = torch.zeros(num_slots, head_dim, dtype=dtype, device=device)
            self.bytes_per_token = head_dim * self.storage.element_size()

    def _offsets(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lay, ps = self.layout, self.page_size
        base = (slots // ps) * self.storage.shape[1]
        data = base + (slots % ps) * lay.data_bytes
        scale = base + ps * lay.data_bytes + (slots % ps) * lay.scale_bytes
        ar = torch.arange
        return (data.unsqueeze(1) + ar(lay.data_bytes, device=slots.device),
                scale.unsqueeze(1) + ar(lay.scale_bytes, device=slots.device))

    def _raw(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        d, s = self._offsets(slots.long())
        flat = self.storage.view(-1)
        return flat[d], flat[s]

    def _put(self, slots: torch.Tensor, data: torch.Tensor, scales: torch.Tensor) -> None:
        d, s = self._offsets(slots.long())
        flat = self.storage.view(-1)
        flat[d], flat[s] = data, scales

    def write(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        if self.layout is None:
            self.storage[slots] = rows.to(self.storage.dtype)
        else:
            self._put(slots, *_encode(rows, self.layout))

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        flat = slots.reshape(-1).long()
        safe = flat.clamp_min(0)
        if self.layout is None:
            rows = self.storage[safe].to(self.compute_dtype)
        else:
            rows = _decode(*self._raw(safe), self.layout, self.compute_dtype)
        return rows.masked_fill((flat < 0).unsqueeze(1), 0).view(*slots.shape, self.head_dim)

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        if self.layout is None:
            self.storage[dst] = self.storage[src]
        else:
            self._put(dst, *self._raw(src))

    def record_bytes(self, slots: torch.Tensor) -> torch.Tensor:
        if self.layout is None:
            return self.storage[slots].view(torch.uint8)
        return torch.cat(self._raw(slots), 1)
