"""FP8 record codec: byte layout, FlashMLA's scale rule, exact and bounded round trips."""
from __future__ import annotations

import math

import pytest
import torch

from dsv4_tree.serving import IndexKeyLayout, RecordLayout, dequantize_rows, quantize_rows

# (head_dim, rope_dim): DeepSeek-V4's 512/64 and the tiny models' 32/8 (one partial 24-value tile)
DIMS = [(512, 64), (32, 8), (200, 8)]


def e4m3_codes(shape, g: torch.Generator) -> torch.Tensor:
    """Random finite float8 e4m3 values as float32 (every byte except the two NaNs)."""
    b = torch.randint(0, 256, shape, generator=g, dtype=torch.int32)
    b = torch.where((b & 0x7F) == 0x7F, b - 1, b).to(torch.uint8)
    return b.view(torch.float8_e4m3fn).to(torch.float32)


def tiles_of(x: torch.Tensor, tile: int) -> list[torch.Tensor]:
    return [x[:, a : a + tile] for a in range(0, x.shape[1], tile)]


def formula_exponent(amax: torch.Tensor) -> torch.Tensor:
    """Transcription of FlashMLA's rule 2^ceil(log2(max(amax / 448, 1e-4))), the division in float32
    as FlashMLA does it, the log2 in float64 so no rounding can move the ceil."""
    x = torch.clamp_min(amax.float() / 448.0, 1e-4).double()
    return torch.ceil(torch.log2(x)).to(torch.int32)


@pytest.mark.parametrize("head_dim,rope_dim", [(512, 64), (32, 8), (576, 64), (128, 0), (64, 63)])
def test_layout_sizes_follow_the_formula(head_dim, rope_dim):
    lay = RecordLayout(head_dim, rope_dim)
    nope = head_dim - rope_dim
    expected = head_dim + rope_dim + 8 * math.ceil(math.ceil(nope / 64) / 8)
    assert lay.bytes_per_token == expected, f"{head_dim=} {rope_dim=}"
    for ps in (256, 16, 1):
        pb = lay.page_bytes(ps)
        assert pb % lay.data_bytes == 0 and ps * expected <= pb < ps * expected + lay.data_bytes, f"{ps=}"


def test_v4_record_is_584_bytes_and_flashmla_page():
    lay = RecordLayout(512, 64)
    assert (lay.nope_dim, lay.n_tiles, lay.data_bytes, lay.scale_bytes) == (448, 7, 576, 8)
    assert lay.bytes_per_token == 584
    assert lay.page_bytes(256) == 260 * 576  # FlashMLA: ceil(256 * 584 / 576) * 576
    assert RecordLayout(32, 8).bytes_per_token == 24 + 16 + 8
    assert IndexKeyLayout(128).bytes_per_token == 132 and IndexKeyLayout(16).bytes_per_token == 20


@pytest.mark.parametrize("head_dim,rope_dim", DIMS)
def test_bytes_match_a_per_tile_transcription(head_dim, rope_dim):
    """Scale bytes follow FlashMLA's formula; codes are (x / s) cast to e4m3; rope is bf16 bytes."""
    g = torch.Generator().manual_seed(head_dim)
    n = 64
    mag = torch.exp2(torch.randint(-20, 20, (n, 1), generator=g).float())
    rows = torch.randn(n, head_dim, generator=g) * mag
    rows[0] = 0.0
    rows[1, :64] = 448.0 * 2.0**-3  # amax / 448 exactly a power of two
    rows[2, :64] = torch.nextafter(torch.tensor(448.0 * 2.0**5), torch.tensor(1e9))  # just above one
    lay = RecordLayout(head_dim, rope_dim)
    data, scales = quantize_rows(rows, lay)
    assert data.dtype == scales.dtype == torch.uint8
    assert data.shape == (n, lay.data_bytes) and scales.shape == (n, lay.scale_bytes)
    nope = rows[:, : lay.nope_dim]
    for t, tile in enumerate(tiles_of(nope, 64)):
        e = formula_exponent(tile.abs().amax(dim=1))
        assert torch.equal(scales[:, t].to(torch.int32), e + 127), f"{t=}"
        codes = (tile / torch.exp2(e.float()).unsqueeze(1)).to(torch.float8_e4m3fn).view(torch.uint8)
        assert torch.equal(data[:, t * 64 : t * 64 + tile.shape[1]], codes), f"{t=}"
    assert torch.equal(scales[:, lay.n_tiles :], torch.zeros_like(scales[:, lay.n_tiles :]))
    rope = rows[:, lay.nope_dim :].to(torch.bfloat16).view(torch.uint8)
    assert torch.equal(data[:, lay.nope_dim :], rope)


@pytest.mark.parametrize("head_dim,rope_dim", DIMS)
def test_representable_rows_round_trip_exactly(head_dim, rope_dim):
    """Nope tiles = e4m3 codes times 2^e with the tile's largest |code| in (224, 448] (so the rule
    picks exactly 2^e); rope values bf16-representable. Decoding must give them back bit for bit."""
    g = torch.Generator().manual_seed(7 + head_dim)
    lay = RecordLayout(head_dim, rope_dim)
    n = 50
    codes = e4m3_codes((n, lay.n_tiles * 64), g)
    top = torch.tensor([256.0, 288.0, 320.0, 352.0, 384.0, 416.0, 448.0])  # the e4m3 values in (224, 448]
    sign = torch.where(torch.rand(n, lay.n_tiles, generator=g) < 0.5, -1.0, 1.0)
    codes[:, ::64] = sign * top[torch.randint(0, len(top), (n, lay.n_tiles), generator=g)]
    e = torch.randint(-8, 12, (n, lay.n_tiles), generator=g)
    nope = (codes.view(n, lay.n_tiles, 64) * torch.exp2(e.float()).unsqueeze(2)).view(n, -1)[:, : lay.nope_dim]
    rope = (torch.randn(n, rope_dim, generator=g) * 3).to(torch.bfloat16).float()
    rows = torch.cat([nope, rope], dim=1)
    data, scales = quantize_rows(rows, lay)
    assert torch.equal(scales[:, : lay.n_tiles].to(torch.int64), e + 127)
    back = dequantize_rows(data, scales, lay, torch.float32)
    assert back.dtype == torch.float32 and torch.equal(back, rows)
    assert torch.equal(dequantize_rows(data, scales, lay, torch.bfloat16), rows.to(torch.bfloat16))


@pytest.mark.parametrize("head_dim,rope_dim", DIMS)
def test_round_trip_error_is_bounded(head_dim, rope_dim):
    """Bound derived from the formats, per element, with s the tile's scale:
    e4m3 normals in [2^k, 2^(k+1)) are 2^(k-3) apart, so round-to-nearest errs by at most
    2^(k-4) <= 2^-4 |x / s|; below 2^-6 (subnormals) codes are 2^-9 apart, error <= 2^-10.
    The rule keeps |x / s| <= 448 (no saturation) and multiplying by s is exact, hence
    |dec - x| <= max(2^-4 |x|, 2^-10 s). The rope part is bf16 (8 significant bits): <= 2^-8 |x|."""
    g = torch.Generator().manual_seed(11 + head_dim)
    lay = RecordLayout(head_dim, rope_dim)
    n = 200
    mag = torch.exp2(torch.empty(n, 1).uniform_(-30, 30, generator=g))
    rows = torch.randn(n, head_dim, generator=g) * mag
    rows[:10] *= torch.rand(10, head_dim, generator=g) < 0.1  # sparse rows: tiny and zero tiles
    data, scales = quantize_rows(rows, lay)
    back = dequantize_rows(data, scales, lay, torch.float32)
    s = torch.exp2(scales[:, : lay.n_tiles].float() - 127).repeat_interleave(64, dim=1)[:, : lay.nope_dim]
    x, err = rows[:, : lay.nope_dim], (back - rows)[:, : lay.nope_dim].abs()
    bound = torch.maximum(x.abs() * 2.0**-4, s * 2.0**-10)
    assert (err <= bound).all(), f"{head_dim=} worst excess {(err - bound).max()}"
    assert err.max() > 0, "random rows must not all be representable (the bound would be untested)"
    r = rows[:, lay.nope_dim :]
    assert ((back[:, lay.nope_dim :] - r).abs() <= r.abs() * 2.0**-8).all()
    assert torch.equal(back.sign() * (back != 0), rows.sign() * (back != 0)), "signs must survive"


def test_zero_rows_and_all_equal_tiles():
    lay = RecordLayout(32 + 64 * 3, 32)  # 192-value nope part: three full tiles
    zeros = torch.zeros(3, lay.head_dim)
    data, scales = quantize_rows(zeros, lay)
    assert torch.equal(data, torch.zeros_like(data))
    assert (scales[:, : lay.n_tiles] == 127 - 13).all()  # ceil(log2(1e-4)) = -13
    assert torch.equal(dequantize_rows(data, scales, lay, torch.float32), zeros)
    consts = torch.tensor([[3.7, -0.001, 2.0**-5], [-1e6, 448.0, -5.0], [1e-9, 0.3, 2.0**20]])
    rows = torch.cat([consts.repeat_interleave(64, dim=1), torch.full((3, 32), -2.5)], dim=1)
    back = dequantize_rows(*quantize_rows(rows, lay), lay, torch.float32)
    for t, tile in enumerate(tiles_of(back[:, :192], 64)):
        c = consts[:, t : t + 1]
        assert (tile == tile[:, :1]).all(), f"{t=}: an all-equal tile decodes to one value"
        s = torch.exp2(torch.clamp_min(c.abs() / 448, 1e-4).log2().ceil())
        bound = torch.maximum(c.abs() * 2.0**-4, s * 2.0**-10)  # as in test_round_trip_error_is_bounded
        assert ((tile - c).abs() <= bound).all(), f"{t=} {tile[:, 0]} vs {c[:, 0]}"
    pow2 = torch.tensor([[2.0**-5, 448.0, 2.0**20]])
    assert torch.equal(back[[0, 1, 2], [128, 64, 128]], pow2[0]), "powers of two and 448 are exact"
    assert (back[:, 192:] == -2.5).all()


def test_index_key_records():
    """e4m3 values + one float32 power-of-two scale per 128 values, s = 2^ceil(log2(max(amax, 1e-4) / 448))."""
    g = torch.Generator().manual_seed(3)
    for dim in (16, 128, 200):
        lay = IndexKeyLayout(dim)
        rows = torch.randn(40, dim, generator=g) * torch.exp2(torch.empty(40, 1).uniform_(-12, 12, generator=g))
        rows[0] = 0
        data, scales = quantize_rows(rows, lay)
        assert data.shape == (40, dim) and scales.shape == (40, 4 * lay.n_blocks)
        s = scales.view(torch.float32)  # [40, n_blocks]
        for b, blk in enumerate(tiles_of(rows, 128)):
            amax = torch.clamp_min(blk.abs().amax(dim=1), 1e-4) / 448.0
            want = torch.exp2(torch.ceil(torch.log2(amax.double()))).float()
            assert torch.equal(s[:, b], want), f"{dim=} {b=}"
        back = dequantize_rows(data, scales, lay, torch.float32)
        sb = s.repeat_interleave(128, dim=1)[:, :dim]
        assert ((back - rows).abs() <= torch.maximum(rows.abs() * 2.0**-4, sb * 2.0**-10)).all(), f"{dim=}"
        exact = back  # decoded values are representable: a second pass must reproduce them exactly
        assert torch.equal(dequantize_rows(*quantize_rows(exact, lay), lay, torch.float32), exact), f"{dim=}"
