"""FP8 records of one K=V row (or one indexer key): the byte codec, no pools, no trees.

KV record (DeepSeek-V4's layout, FlashMLA `MODEL1_FP8Sparse` at head_dim 512 / rope 64):
channels are `[nope | rope]` (RoPE acts on the trailing `rope_dim` channels). Per token

* data record: the `nope_dim = head_dim - rope_dim` values as float8 e4m3 (one byte each), then the
  `rope_dim` values as bfloat16 (two little-endian bytes each);
* scale record: one ue8m0 byte (biased power-of-two exponent, bias 127) per 64-value tile of the
  nope part, zero-padded to a multiple of 8 bytes.

    bytes_per_token(d, r, tile=64) = (d - r) + 2 r + 8 * ceil(ceil((d - r) / tile) / 8)
                                   = d + r + 8 * ceil(ceil((d - r) / tile) / 8)

    d=512, r=64: 448 + 128 + 8 = 584  (7 tiles -> 8 scale bytes)
    d=32,  r=8:  24 + 16 + 8   = 48   (1 partial tile -> 8 scale bytes)

A page of `page_size` tokens stores every token's data record first, then every token's scale
record, padded to a multiple of `data_bytes` (`page_bytes`).

Scale rule (FlashMLA's test quantiser): per tile, s = 2^ceil(log2(max(amax / 448, 1e-4))), with
`amax / 448` evaluated in float32 and the ceil-log2 taken exactly from the float32 bits (FlashMLA
takes it with a float32 `log2`, which agrees except where that rounding lands an argument just
above a power of two on the integer below; both choices keep every |x / s| <= 448). Values are
divided by s (exact: a power of two) and cast to e4m3 with round-to-nearest-even; the rope part is
cast to bfloat16 (round-to-nearest-even). Decoding multiplies each code by its tile's s.

Indexer-key record (`IndexKeyLayout`, the layout serving engines use for the C4 indexer-key cache):
all `dim` values as e4m3 plus one float32 scale per 128-value block,
s = 2^ceil(log2(max(amax, 1e-4) / 448)) (the `ue8m0` scale format); data records then scale records
per page, no page padding: bytes_per_token(dim, block=128) = dim + 4 * ceil(dim / block).

Inputs must be finite (a NaN or inf amax has no power-of-two scale)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ConfigError

E4M3_MAX = 448.0
SCALE_FLOOR = 1e-4
E8M0_BIAS = 127


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class RecordLayout:
    """Byte layout of one token's KV record."""

    head_dim: int
    rope_dim: int
    tile: int = 64

    def __post_init__(self):
        if self.head_dim <= 0 or self.tile <= 0:
            raise ConfigError(f"RecordLayout needs head_dim > 0 and tile > 0, got {self.head_dim=} "
                              f"{self.tile=}")
        if not 0 <= self.rope_dim < self.head_dim:
            raise ConfigError(f"RecordLayout needs 0 <= rope_dim < head_dim, got {self.rope_dim=} "
                              f"{self.head_dim=}")

    @property
    def nope_dim(self) -> int:
        return self.head_dim - self.rope_dim

    @property
    def n_tiles(self) -> int:
        return _cdiv(self.nope_dim, self.tile)

    @property
    def data_bytes(self) -> int:
        return self.nope_dim + 2 * self.rope_dim

    @property
    def scale_bytes(self) -> int:
        return 8 * _cdiv(self.n_tiles, 8)

    @property
    def bytes_per_token(self) -> int:
        return self.data_bytes + self.scale_bytes

    def page_bytes(self, page_size: int) -> int:
        return _cdiv(page_size * self.bytes_per_token, self.data_bytes) * self.data_bytes


@dataclass(frozen=True)
class IndexKeyLayout:
    """Byte layout of one token's FP8 indexer key: e4m3 values + one float32 scale per block."""

    dim: int
    block: int = 128

    def __post_init__(self):
        if self.dim <= 0 or self.block <= 0:
            raise ConfigError(f"IndexKeyLayout needs dim > 0 and block > 0, got {self.dim=} {self.block=}")

    @property
    def n_blocks(self) -> int:
        return _cdiv(self.dim, self.block)

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


def ceil_log2(x: torch.Tensor) -> torch.Tensor:
    """Exact ceil(log2(x)) of positive normal float32 values, from their bits -> int32."""
    bits = x.to(torch.float32).view(torch.int32)
    exponent = (bits >> 23) - E8M0_BIAS
    return exponent + ((bits & 0x7FFFFF) != 0).to(torch.int32)


def pow2(exponent: torch.Tensor) -> torch.Tensor:
    """2^exponent as float32, exactly, for int32 exponents in [-126, 127]."""
    return ((exponent + E8M0_BIAS) << 23).view(torch.float32)


def _tiles(x: torch.Tensor, tile: int) -> torch.Tensor:
    """[n, c] -> [n, ceil(c / tile), tile], zero-padded (zeros never raise a tile's amax)."""
    n, c = x.shape
    pad = _cdiv(c, tile) * tile - c
    return torch.nn.functional.pad(x, (0, pad)).view(n, (c + pad) // tile, tile)


def _e4m3_bytes(scaled: torch.Tensor) -> torch.Tensor:
    return scaled.to(torch.float8_e4m3fn).view(torch.uint8)


def _e4m3_values(codes: torch.Tensor) -> torch.Tensor:
    # clone(): a fresh buffer at storage offset 0, so every dtype view below is aligned
    return codes.clone().view(torch.float8_e4m3fn).to(torch.float32)


def quantize_rows(rows: torch.Tensor,
                  layout: RecordLayout | IndexKeyLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [n, head_dim] float -> (data uint8 [n, data_bytes], scales uint8 [n, scale_bytes])."""
    if isinstance(layout, IndexKeyLayout):
        return _quantize_index_keys(rows, layout)
    n = rows.shape[0]
    x = rows.to(torch.float32)
    tiles = _tiles(x[:, : layout.nope_dim], layout.tile)  # [n, n_tiles, tile]
    amax = tiles.abs().amax(dim=-1)  # [n, n_tiles]
    exponent = ceil_log2(torch.clamp_min(amax / E4M3_MAX, SCALE_FLOOR))  # [n, n_tiles]
    codes = _e4m3_bytes(tiles * pow2(-exponent).unsqueeze(-1)).flatten(1)[:, : layout.nope_dim]
    rope = x[:, layout.nope_dim :].to(torch.bfloat16).view(torch.uint8)  # [n, 2 * rope_dim]
    data = torch.cat([codes, rope], dim=1)
    scales = torch.zeros(n, layout.scale_bytes, dtype=torch.uint8, device=rows.device)
    scales[:, : layout.n_tiles] = (exponent + E8M0_BIAS).to(torch.uint8)
    return data, scales


def dequantize_rows(data: torch.Tensor, scales: torch.Tensor, layout: RecordLayout | IndexKeyLayout,
                    dtype: torch.dtype) -> torch.Tensor:
    """(data uint8 [n, data_bytes], scales uint8 [n, scale_bytes]) -> rows [n, head_dim] in dtype."""
    if isinstance(layout, IndexKeyLayout):
        return _dequantize_index_keys(data, scales, layout, dtype)
    codes = _tiles(_e4m3_values(data[:, : layout.nope_dim]), layout.tile)  # [n, n_tiles, tile]
    scale = pow2(scales[:, : layout.n_tiles].to(torch.int32) - E8M0_BIAS)  # [n, n_tiles]
    nope = (codes * scale.unsqueeze(-1)).flatten(1)[:, : layout.nope_dim]
    rope = data[:, layout.nope_dim :].clone().view(torch.bfloat16).to(torch.float32)
    return torch.cat([nope, rope], dim=1).to(dtype)


def _quantize_index_keys(rows: torch.Tensor, layout: IndexKeyLayout) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = _tiles(rows.to(torch.float32), layout.block)  # [n, n_blocks, block]
    amax = blocks.abs().amax(dim=-1)  # [n, n_blocks]
    exponent = ceil_log2(torch.clamp_min(amax, SCALE_FLOOR) / E4M3_MAX)
    data = _e4m3_bytes(blocks * pow2(-exponent).unsqueeze(-1)).flatten(1)[:, : layout.dim]
    scales = pow2(exponent).view(torch.uint8)  # [n, 4 * n_blocks], little-endian float32
    return data, scales


def _dequantize_index_keys(data: torch.Tensor, scales: torch.Tensor, layout: IndexKeyLayout,
                           dtype: torch.dtype) -> torch.Tensor:
    codes = _tiles(_e4m3_values(data), layout.block)  # [n, n_blocks, block]
    scale = scales.clone().view(torch.float32)  # [n, n_blocks]
    # contiguous: a fresh tensor of the rows alone (KVPool.read fills it in place)
    return (codes * scale.unsqueeze(-1)).flatten(1)[:, : layout.dim].to(dtype).contiguous()
