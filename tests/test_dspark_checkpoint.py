"""DSpark in DeepSeek's release layout: writing and loading (bundled, dspark/ subfolder, the
release format), telling it apart from an MTP block, and refusing malformed modules by name."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import dsv4_tree as dt
from dsv4_tree.checkpoint.dspark import DSparkSettings
from dsv4_tree.checkpoint.dspark_names import (add_dspark_to_checkpoint, find_dspark, load_dspark,
                                               to_checkpoint_names, write_dspark)
from dsv4_tree.checkpoint.files import read_tensors
from dsv4_tree.checkpoint.mtp import load_mtp
from dsv4_tree.checkpoint.quant import dequantize_weight
from dsv4_tree.checkpoint.release import SCALE_SUFFIX, quantize_release, write_release
from dsv4_tree.drafters import DSparkDrafter, TreeShape
from dsv4_tree.checkpoint.tiny import (RELEASE_TINY_OVERRIDES, random_dspark, random_model, tiny_config,
                                       write_random_checkpoint)

SETTINGS = DSparkSettings(block_size=4, markov_rank=8, noise_token_id=500, target_layer_ids=(1, 2, 3))


def _target(tmp_path, name="target"):
    return write_random_checkpoint(tmp_path / name, tiny_config(), with_mtp=False)


def _same(a, b) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def test_subfolder_round_trip_is_bitwise(tmp_path):
    d = _target(tmp_path)
    module = random_dspark(tiny_config(), SETTINGS)
    write_dspark(d, module, tiny_config())
    loaded = load_dspark(dt.load_model(d))
    assert loaded.settings == SETTINGS
    _same(loaded, module)
    assert sorted(load_file(str(d / "dspark" / "model.safetensors"))) == sorted(to_checkpoint_names(module))


def test_bundled_module_loads_and_its_names_are_deepseeks(tmp_path):
    d = _target(tmp_path)
    module = random_dspark(tiny_config(), SETTINGS)
    add_dspark_to_checkpoint(d, module)
    names = set(load_file(str(d / "model.safetensors")))
    for n in ("mtp.0.main_proj.weight", "mtp.0.main_norm.weight", "mtp.2.markov_head.embed.weight",
              "mtp.2.markov_head.head.weight", "mtp.2.confidence_head.proj.weight", "mtp.2.norm.weight",
              "mtp.2.hc_head_fn", "mtp.1.attn.wkv.weight", "mtp.1.attn.attn_sink", "mtp.0.ffn.experts.3.w2.weight",
              "mtp.2.hc_attn_fn", "mtp.0.attn_norm.weight"):
        assert n in names, n
    model = dt.load_model(d)
    _same(load_dspark(model), module)
    with pytest.raises(dt.CheckpointError, match="DSpark module"):
        load_mtp(model)  # mtp.* here is DSpark, not an MTP block


def test_an_mtp_checkpoint_is_not_dspark(tmp_path):
    d = write_random_checkpoint(tmp_path / "mtp", tiny_config())
    assert find_dspark(d) is None
    model = dt.load_model(d)
    with pytest.raises(dt.CheckpointError, match="no DSpark module"):
        load_dspark(model)
    load_mtp(model)  # still the MTP block
    with pytest.raises(dt.CheckpointError, match="already holds mtp.0"):
        add_dspark_to_checkpoint(d, random_dspark(tiny_config(), SETTINGS))


def test_mtp_block_and_dspark_subfolder_side_by_side(tmp_path):
    d = write_random_checkpoint(tmp_path / "both", tiny_config())
    module = random_dspark(tiny_config(), SETTINGS)
    write_dspark(d, module, tiny_config())
    model = dt.load_model(d)
    load_mtp(model)
    _same(load_dspark(model), module)


def test_release_format_round_trip(tmp_path):
    config = tiny_config(**RELEASE_TINY_OVERRIDES)
    module = random_dspark(config, SETTINGS)
    d = write_release(tmp_path / "rel", random_model(config), dspark=module)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["dspark_block_size"] == 4 and cfg["dspark_target_layer_ids"] == [1, 2, 3]
    loaded = load_dspark(dt.load_model(d))
    # what the release stores, decoded independently of the loader: FP8 / FP4 blocks times their scales
    stored, _ = quantize_release(to_checkpoint_names(module))
    raw = read_tensors(d, "mtp.")
    assert any(k + SCALE_SUFFIX in stored for k in raw), "some DSpark linears must be stored quantised"
    for name, value in to_checkpoint_names(loaded).items():
        want = dequantize_weight(name, stored[name], stored[name + SCALE_SUFFIX], torch.float32) \
            if name + SCALE_SUFFIX in stored else stored[name].float()
        assert torch.equal(value, want), name
    again = write_release(tmp_path / "rel2", random_model(config), dspark=loaded)
    assert load_file(str(again / "model-00003-of-00003.safetensors")).keys() == \
        load_file(str(d / "model-00003-of-00003.safetensors")).keys()
    with pytest.raises(dt.CheckpointError, match="both be stored as mtp"):
        write_release(tmp_path / "x", random_model(config), mtp=object(), dspark=module)


def _edit_config(d, **changes):
    path = d / "dspark" / "config.json"
    cfg = json.loads(path.read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k)
        else:
            cfg[k] = v
    path.write_text(json.dumps(cfg))


def _edit_tensors(d, fn):
    path = d / "dspark" / "model.safetensors"
    t = load_file(str(path))
    fn(t)
    save_file(t, str(path))


@pytest.mark.parametrize("edit,match", [
    (lambda d: _edit_config(d, dspark_block_size=0), "dspark_block_size must be an int >= 1"),
    (lambda d: _edit_config(d, dspark_block_size=2.5), "dspark_block_size must be an int >= 1"),
    (lambda d: _edit_config(d, dspark_noise_token_id=512), r"dspark_noise_token_id 512 is outside the vocabulary \[0, 512\)"),
    (lambda d: _edit_config(d, dspark_target_layer_ids=[1, 2, 4]), "entry 4 is not a target layer"),
    (lambda d: _edit_config(d, dspark_target_layer_ids=[]), "non-empty list"),
    (lambda d: _edit_config(d, dspark_target_layer_ids=[1, 1, 2]), "repeats a layer"),
    (lambda d: _edit_config(d, dspark_markov_rank=None), "dspark_markov_rank is missing"),
    (lambda d: _edit_config(d, dspark_markov_rank=0), "dspark_markov_rank must be an int >= 1"),
    (lambda d: _edit_config(d, hidden_size=128), "hidden_size is 128, the target's is 64"),
    # the stages' MoE top-k above their routed experts (the target's 4, or the module's own count)
    (lambda d: _edit_config(d, dspark_num_experts_per_tok=5),
     r"dspark_num_experts_per_tok is 5, more than the stages' 4 routed experts \(the target's n_routed_experts\); "
     "it must be <= 4"),
    (lambda d: _edit_config(d, dspark_target_layer_ids=[2, 1, 3]), r"\[2, 1, 3\] is not ascending"),
    (lambda d: _edit_config(d, dspark_window_size=8), "unknown DSpark config key dspark_window_size"),
    (lambda d: _edit_config(d, dspark_ffn_hidden_size=64), "dspark_ffn_hidden_size is not supported"),
    (lambda d: _edit_config(d, dspark_markov_head_type="gated"), "dspark_markov_head_type is 'gated', supported: 'vanilla'"),
    (lambda d: _edit_config(d, hc_pre_from_prev_sublayer=True), "hc_pre_from_prev_sublayer is True, supported: False"),
    (lambda d: _edit_config(d, model_type="deepseek_v41"), "model_type is 'deepseek_v41', supported: 'deepseek_v4'"),
    (lambda d: _edit_config(d, sample_from_anchor="yes"), "sample_from_anchor must be true or false"),
    (lambda d: _edit_config(d, block_size=7), "block_size is 7 but dspark_block_size is 4"),
    (lambda d: _edit_tensors(d, lambda t: t.pop("mtp.2.markov_head.head.weight")),
     r"tensor mtp\.2\.markov_head\.head\.weight is missing"),
    (lambda d: _edit_tensors(d, lambda t: t.pop("mtp.1.attn.wkv.weight")), r"tensor mtp\.1\.attn\.wkv\.weight is missing"),
    (lambda d: _edit_tensors(d, lambda t: t.pop("mtp.0.ffn.experts.2.w3.weight")), r"mtp\.0\.ffn\.experts\.2\.w3\.weight"),
    (lambda d: _edit_tensors(d, lambda t: t.update({"mtp.0.main_proj.weight": torch.zeros(64, 128)})),
     r"mtp\.0\.main_proj\.weight has shape \(64, 128\), expected \(64, 192\)"),
    (lambda d: _edit_tensors(d, lambda t: t.update({"mtp.3.attn.wkv.weight": torch.zeros(32, 64)})),
     "belongs to no DSpark stage"),
    (lambda d: _edit_tensors(d, lambda t: t.update({"mtp.1.main_proj.weight": torch.zeros(64, 192)})),
     "unrecognised DSpark tensor 'mtp.1.main_proj.weight'"),
])
def test_malformed_modules_are_refused_by_name(tmp_path, edit, match):
    d = _target(tmp_path)
    write_dspark(d, random_dspark(tiny_config(), SETTINGS), tiny_config())
    edit(d)
    with pytest.raises(dt.CheckpointError, match=match):
        load_dspark(dt.load_model(d))


def test_stage_topk_up_to_the_stage_experts_loads_and_drafts(tmp_path):
    """The bound is the stages' own expert count: dspark_n_routed_experts 6 allows top-k 5 (above
    the target's 4 experts), and the module drafts with it."""
    d = _target(tmp_path)
    settings = DSparkSettings(4, 8, 500, (1, 2, 3), n_routed_experts=6, num_experts_per_tok=5)
    write_dspark(d, random_dspark(tiny_config(), settings), tiny_config())
    model = dt.load_model(d)
    module = load_dspark(model)
    assert module.settings.num_experts_per_tok == 5
    eng = dt.Engine(model, dt.SpecConfig(eagle_topk=1, num_steps=4, num_draft_tokens=5))
    res = eng.generate(torch.arange(3, 12), 6, drafter=DSparkDrafter(model, TreeShape(1, 4, 5), module), progress=False)
    assert len(res.tokens) == 6
    _edit_config(d, dspark_num_experts_per_tok=7)
    with pytest.raises(dt.CheckpointError, match=r"dspark_num_experts_per_tok is 7, more than the stages' 6 routed "
                       r"experts \(dspark_n_routed_experts\)"):
        load_dspark(dt.load_model(d))
