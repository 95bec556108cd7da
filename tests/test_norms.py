"""rms_norm (numerics/norms.py) against transformers' norm modules: weighted and unweighted, fp32
through the fused op, other dtypes through the module."""
import pytest
import torch

from dsv4_tree.numerics.norms import rms_norm
from dsv4_tree.checkpoint.tiny import random_model, tiny_config


@pytest.fixture(scope="module")
def layer():
    torch.manual_seed(0)
    hf = random_model(tiny_config())
    layer = hf.model.layers[1]
    with torch.no_grad():
        for m in (layer.input_layernorm, layer.self_attn.q_a_norm, layer.self_attn.kv_norm):
            m.weight.uniform_(0.5, 1.5)
    return layer


@pytest.mark.parametrize("rows", [1, 8])
def test_fp32_equals_the_modules(layer, rows):
    attn = layer.self_attn
    cases = [(layer.input_layernorm, layer.input_layernorm.weight.shape[0]), (attn.q_a_norm, attn.q_a_norm.weight.shape[0]),
             (attn.kv_norm, attn.head_dim), (attn.q_b_norm, attn.head_dim), (layer.attn_hc.input_norm, 64)]
    for module, d in cases:
        x = torch.randn(1, rows, 3, d) * 3
        with torch.no_grad():  # same expression; the fused op may reduce in another order (1e-6, not bitwise)
            torch.testing.assert_close(rms_norm(module, x), module(x), rtol=1e-6, atol=0, msg=type(module).__name__)


def test_other_dtypes_go_through_the_module(layer):
    x = torch.randn(1, 2, layer.input_layernorm.weight.shape[0]).bfloat16()
    with torch.no_grad():
        assert torch.equal(rms_norm(layer.input_layernorm, x), layer.input_layernorm(x))
        assert torch.equal(rms_norm(layer.self_attn.q_b_norm, x), layer.self_attn.q_b_norm(x))
