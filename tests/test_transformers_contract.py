"""Fails loudly if the transformers DeepSeek-V4 internals this package reads change."""
import inspect

import torch
import transformers

from dsv4_tree import hf_bindings as hb
from cases import small_model


def test_pinned_version():
    assert transformers.__version__ == hb.REQUIRED_TRANSFORMERS, (
        f"dsv4_tree is written against transformers=={hb.REQUIRED_TRANSFORMERS}, found {transformers.__version__}"
    )


def test_module_fields_we_read():
    model = small_model()
    hf = model.hf
    for name in ("embed_tokens", "layers", "norm", "rotary_emb", "hc_head"):
        assert hasattr(hf.model, name), name
    assert hasattr(hf, "lm_head")
    for layer in hf.model.layers:
        for name in ("attn_hc", "ffn_hc", "input_layernorm", "post_attention_layernorm", "mlp", "self_attn"):
            assert hasattr(layer, name), name
        attn = layer.self_attn
        for name in ("q_a_proj", "q_a_norm", "q_b_proj", "q_b_norm", "kv_proj", "kv_norm", "o_a_proj", "o_b_proj",
                     "sinks", "compressor", "num_heads", "head_dim", "scaling", "rope_layer_type", "config"):
            assert hasattr(attn, name), name
        comp = attn.compressor
        if comp is None:
            continue
        for name in ("kv_proj", "gate_proj", "position_bias", "kv_norm", "compress_rate", "head_dim"):
            assert hasattr(comp, name), name
        if isinstance(comp, hb.DeepseekV4CSACompressor):
            assert comp.position_bias.shape == (comp.compress_rate, 2 * comp.head_dim)
            idx = comp.indexer
            assert isinstance(idx, hb.DeepseekV4Indexer)
            for name in ("kv_proj", "gate_proj", "position_bias", "kv_norm", "q_b_proj", "scorer", "num_heads",
                         "head_dim", "index_topk", "compress_rate"):
                assert hasattr(idx, name), name
            for name in ("weights_proj", "softmax_scale", "weights_scaling"):
                assert hasattr(idx.scorer, name), name
        else:
            assert isinstance(comp, hb.DeepseekV4HCACompressor)
            assert comp.position_bias.shape == (comp.compress_rate, comp.head_dim)


def test_helpers_behave_as_assumed():
    sig = inspect.signature(hb.apply_rotary_pos_emb)
    assert list(sig.parameters)[:3] == ["x", "cos", "sin"]
    model = small_model()
    x = torch.zeros(1, 3, 8)
    cos, sin = model.hf.model.rotary_emb(x, position_ids=torch.arange(3).unsqueeze(0), layer_type="compress")
    assert cos.shape == (1, 3, model.config.qk_rope_head_dim // 2)
    # HF's cache layout we compare against in tests
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4CSACache, DeepseekV4HCACache

    c = DeepseekV4CSACache(model.config)
    for name in ("buffer_kv", "buffer_gate", "compressed_kv", "entry_count", "overlap_kv", "overlap_gate"):
        assert hasattr(c, name), name
    assert issubclass(DeepseekV4CSACache, DeepseekV4HCACache)
    assert hb.DeepseekV4ForCausalLM._keys_to_ignore_on_load_unexpected == [r"(^|\.)mtp\..*"]
