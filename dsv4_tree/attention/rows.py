"""The per-row work around a layer's attention core, one contract per step and two backends:

    q_res, q = q_rows(attn, x, rope)                 # q_a_proj, q_a_norm; q_b_proj, q_b_norm, RoPE
    swa_write(attn, x, rope, pool, slots)            # kv_proj, kv_norm, RoPE, the SWA pool's store
    y = rope_rows(x, rope, key, inverse=False)       # RoPE of rows' heads (indexer query, output)

x [1, T, hidden]; rope: the verify's RowRope; q_res [1, T, q_lora_rank]; q [T, H, d] contiguous;
rope_rows takes and returns transformers' layout [1, H, T, d] (any strides; the Triton entry
returns a view of a contiguous [T, H, d]). The torch entries are transformers' modules through
numerics/ (norms.py, rope.py with full-width tables from `RowRope.full`): the readable path. The
Triton entries run the projections as torch linears and everything between them as one launch
each (kernels/norm_rope.py, kernels/kv_write.py), rotating from `RowRope.pair`'s tables as they
are; their norms pin the mean square's summation order and round sqrt / division correctly, so
they agree with the torch entries to the last bit or two (tests/test_norm_rope_kernels.py)."""
from __future__ import annotations

from ..numerics.norms import rms_norm
from ..numerics.rope import apply_rope
from .layer import kv_rows


def q_rows(attn, x, rope):
    t, h, d = x.shape[1], attn.num_heads, attn.head_dim
    cos, sin = rope.full(attn.rope_layer_type, d)
    q_res = rms_norm(attn.q_a_norm, attn.q_a_proj(x))
    q = rms_norm(attn.q_b_norm, attn.q_b_proj(q_res).view(1, t, h, d).transpose(1, 2))
    return q_res, apply_rope(q, cos, sin)[0].transpose(0, 1).contiguous()


def swa_write(attn, x, rope, pool, slots) -> None:
    cos, sin = rope.full(attn.rope_layer_type, attn.head_dim)
    pool.write(slots, kv_rows(attn, x, cos, sin, apply_rope))


def rope_rows(x, rope, key, inverse: bool = False):
    cos, sin = rope.full(key, x.shape[-1], inverse=inverse)
    return apply_rope(x, cos, sin)


def triton_q_rows(attn, x, rope):
    from .. import kernels

    t, h, d = x.shape[1], attn.num_heads, attn.head_dim
    q_a = attn.q_a_norm
    q_res = kernels.norm_rope(attn.q_a_proj(x)[0], q_a.variance_epsilon, q_a.weight.detach()).unsqueeze(0)
    cos, sin = rope.pair(attn.rope_layer_type)
    q = kernels.norm_rope(attn.q_b_proj(q_res).view(t, h, d), attn.q_b_norm.eps, cos=cos, sin=sin)
    return q_res, q


def triton_swa_write(attn, x, rope, pool, slots) -> None:
    from .. import kernels

    cos, sin = rope.pair(attn.rope_layer_type)
    norm = attn.kv_norm
    kernels.kv_write(pool, slots, attn.kv_proj(x)[0], norm.weight.detach(), norm.variance_epsilon, cos, sin)


def triton_rope_rows(x, rope, key, inverse: bool = False):
    from .. import kernels

    cos, sin = rope.pair(key)
    return kernels.norm_rope(x[0].transpose(0, 1), cos=cos, sin=sin, inverse=inverse).transpose(0, 1).unsqueeze(0)
