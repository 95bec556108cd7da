"""The indexer's Walsh-Hadamard rotation (numerics/hadamard.py) against its definition
y[k] = d^-1/2 sum_j (-1)^popcount(j & k) x[j], and its row independence."""
import pytest
import torch

from dsv4_tree.errors import ConfigError
from dsv4_tree.numerics.hadamard import hadamard_rotate


def sylvester(d: int) -> torch.Tensor:
    sign = [[(-1) ** bin(j & k).count("1") for k in range(d)] for j in range(d)]
    return torch.tensor(sign, dtype=torch.float64) * d ** -0.5


@pytest.mark.parametrize("d", [1, 2, 8, 128])
def test_hadamard_matches_its_definition(d):
    x = torch.randn(6, d, generator=torch.Generator().manual_seed(d))
    got = hadamard_rotate(x)
    want = (x.double() @ sylvester(d)).float()
    # 7 rounds of fp32 adds of values of size ~sqrt(d)|x|: a few ulps of the result
    assert torch.allclose(got, want, rtol=0, atol=1e-5 * max(1.0, float(want.abs().max()))), f"{d=}"
    assert torch.allclose(hadamard_rotate(got), x, atol=1e-5), f"{d=}: the rotation is its own inverse"


def test_hadamard_rows_do_not_depend_on_their_batch():
    x = torch.randn(9, 128, generator=torch.Generator().manual_seed(0))
    whole = hadamard_rotate(x)
    assert all(torch.equal(whole[i], hadamard_rotate(x[i:i + 1])[0]) for i in range(9))


def test_hadamard_refuses_other_widths():
    with pytest.raises(ConfigError, match="power of two"):
        hadamard_rotate(torch.zeros(2, 96))
