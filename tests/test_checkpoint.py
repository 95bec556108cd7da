"""The embedded tiny checkpoint: made deterministically, loaded through dt.load_model."""
import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import DeepseekV4ForCausalLM

import dsv4_tree as dt
from cases import assert_weights_from_file
from dsv4_tree.checkpoint.tiny import write_random_checkpoint


def test_tiny_checkpoint_layout_and_config():
    path = dt.tiny_checkpoint()
    assert (path / "config.json").is_file() and (path / "model.safetensors").is_file()
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v4"
    assert set(cfg["layer_types"]) == {"sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"}
    assert cfg["compress_rates"] == {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
    assert set(cfg["mlp_layer_types"]) == {"hash_moe", "moe"}


def test_deterministic(tmp_path):
    a = load_file(str(write_random_checkpoint(tmp_path / "a") / "model.safetensors"))
    b = load_file(str(write_random_checkpoint(tmp_path / "b") / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_nontrivial_sinks_bias_and_hash_table():
    """Zeros here (HF's initializer) would hide bugs in exactly the code tree verify changes."""
    hf = dt.load_model(dt.tiny_checkpoint()).hf
    names = [k for k in load_file(str(dt.tiny_checkpoint() / "model.safetensors"))]
    assert any(k.endswith("attn_sink") for k in names) and any(k.endswith("ape") for k in names)
    for layer in hf.model.layers:
        attn = layer.self_attn
        assert attn.sinks.abs().min() > 0
        if attn.compressor is not None:
            assert attn.compressor.position_bias.abs().min() > 0
            if hasattr(attn.compressor, "indexer"):
                assert attn.compressor.indexer.position_bias.abs().min() > 0
        if layer.mlp.is_hash:
            tid = layer.mlp.gate.tid2eid
            assert len(set(tid.flatten().tolist())) == hf.config.n_routed_experts
            assert (tid[:, 0] != tid[:, 1]).all()


def test_load_model_reads_every_weight_of_the_file():
    path = dt.tiny_checkpoint()
    ours = dt.load_model(path)
    assert_weights_from_file(ours.hf, path)
    # the adapter shares the weights of a module it wraps, it does not copy them
    plain = DeepseekV4ForCausalLM(ours.config)
    assert dt.load_model(plain).hf.lm_head.weight.data_ptr() == plain.lm_head.weight.data_ptr()


def test_load_errors(tmp_path):
    with pytest.raises(dt.CheckpointError, match="not found"):
        dt.load_model(tmp_path / "nope")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(dt.CheckpointError, match="safetensors"):
        dt.load_model(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(dt.CheckpointError, match="expected 'deepseek_v4'"):
        dt.load_model(tmp_path)
    with pytest.raises(dt.CheckpointError, match="DeepseekV4ForCausalLM"):
        dt.load_model(42)
