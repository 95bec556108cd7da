"""Our RoPE (numerics/rope.py) equals transformers' apply_rotary_pos_emb, with fewer ops."""
import pytest
import torch

from dsv4_tree.diagnostics import OpCounter
from dsv4_tree.hf_bindings import apply_rotary_pos_emb
from dsv4_tree.numerics.rope import apply_rope, rope_pairs, rope_tables


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 4, 3, 32), (1, 1, 7, 16), (1, 2, 1, 64)])
@pytest.mark.parametrize("rope_dim", [8, 16])
def test_rope_equals_transformers(dtype, shape, rope_dim):
    gen = torch.Generator().manual_seed(sum(shape) + rope_dim)
    x = torch.randn(*shape, generator=gen).to(dtype)
    angles = torch.rand(1, shape[2], rope_dim // 2, generator=gen) * 50
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    c2, s2 = rope_pairs(cos, sin)
    for s, ours in ((sin, s2), (-sin, -s2)):  # forward rope; the inverse rope of attention outputs
        want = apply_rotary_pos_emb(x, cos, s)
        for got in (apply_rope(x, c2, ours), apply_rope(x, *rope_tables(c2, ours, shape[-1]))):  # pair, full width
            assert got.dtype == want.dtype and got.shape == want.shape
            assert torch.equal(got, want), (got.float() - want.float()).abs().max()


def test_rope_uses_fewer_ops():
    x, cos, sin = torch.randn(1, 4, 2, 32), torch.randn(1, 2, 8), torch.randn(1, 2, 8)
    c2, s2 = rope_pairs(cos, sin)  # once per forward
    with OpCounter() as ours:
        apply_rope(x, c2, s2)
    with OpCounter() as theirs:
        apply_rotary_pos_emb(x, cos, sin)
    assert ours.total < 0.6 * theirs.total, (ours.total, theirs.total)  # 11 vs 21 with torch 2.13


def test_full_width_tables_take_fewer_ops_and_refuse_a_width_without_room():
    x, cos, sin = torch.randn(1, 4, 2, 32), torch.randn(1, 2, 8), torch.randn(1, 2, 8)
    c2, s2 = rope_pairs(cos, sin)
    full = rope_tables(c2, s2, 32)  # once per forward and head width
    assert full[0].shape == (1, 1, 2, 32)
    with OpCounter() as pairs:
        apply_rope(x, c2, s2)
    with OpCounter() as wide:
        apply_rope(x, *full)
    assert wide.total < 0.6 * pairs.total, (wide.total, pairs.total)  # 6 vs 11 with torch 2.13
    with pytest.raises(ValueError, match="width 12 cannot hold 8 rope pairs"):
        rope_tables(c2, s2, 12)
    with pytest.raises(ValueError, match="width 17"):
        rope_tables(c2, s2, 17)
