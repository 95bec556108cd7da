"""SpecConfig and the config hooks (pure functions of model config and spec)."""
from pathlib import Path

import pytest

import dsv4_tree as dt
from dsv4_tree.hooks import candidate_pool_size, validate_spec

CFG = dt.tiny_config()


def test_default_is_chain():
    spec = dt.SpecConfig()
    assert spec.eagle_topk == 1 and spec.num_draft_tokens == spec.num_steps + 1
    plan = validate_spec(CFG, spec)
    assert not plan.tree_mode and plan.max_nodes == 4 and plan.max_depth == 3


def test_tree_mode_and_pool_limit():
    assert candidate_pool_size(4, 5) == 4 + 4 * 16
    plan = validate_spec(CFG, dt.SpecConfig(eagle_topk=4, num_steps=5, num_draft_tokens=69))
    assert plan.tree_mode
    with pytest.raises(dt.ConfigError, match=r"num_draft_tokens=70 exceeds the candidate pool \+ root = 69"):
        validate_spec(CFG, dt.SpecConfig(eagle_topk=4, num_steps=5, num_draft_tokens=70))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(eagle_topk=0), "eagle_topk must be >= 1"),
        (dict(num_steps=0, num_draft_tokens=1), "num_steps must be >= 1"),
        (dict(num_draft_tokens=9), "exceeds num_steps \\+ 1"),
        (dict(eagle_topk=2, num_steps=3), "num_draft_tokens must be set"),
        (dict(eagle_topk=4, num_steps=6, num_draft_tokens=33, mask_mode="QLEN_ONLY_BITPACKING"), "at most 32"),
        (dict(mask_mode="DIAGONAL"), "mask_mode='DIAGONAL' is unknown"),
        (dict(attention_backend="cuda-magic"), "attention_backend='cuda-magic' is not available"),
        (dict(accept="beam"), "accept='beam' is unknown"),
        (dict(prefill_chunk=0), "prefill_chunk must be >= 1"),
    ],
)
def test_refusals_name_the_field(kwargs, match):
    with pytest.raises(dt.ConfigError, match=match):
        validate_spec(CFG, dt.SpecConfig(**kwargs))


def test_type_errors():
    with pytest.raises(dt.ConfigError, match="eagle_topk must be an int"):
        dt.SpecConfig(eagle_topk="4")


def test_model_checks():
    bad = dt.tiny_config(max_position_embeddings=4)
    with pytest.raises(dt.ConfigError, match="max_position_embeddings"):
        validate_spec(bad, dt.SpecConfig())


@pytest.mark.parametrize("path", sorted(Path(__file__).parent.parent.glob("configs/*.toml")))
def test_presets_load(path, tmp_path):
    if path.name == "tiny_model.toml":
        import tomllib

        data = tomllib.loads(path.read_text())["model"]
        for k, v in data.items():
            assert getattr(dt.tiny_config(), k) == v, k
        return
    spec = dt.SpecConfig.from_file(path)
    validate_spec(CFG, spec)


def test_from_file_errors(tmp_path):
    f = tmp_path / "x.toml"
    f.write_text("[spec]\neagle_topk = 2\nnum_draft = 4\n")
    with pytest.raises(dt.ConfigError, match="unknown SpecConfig field"):
        dt.SpecConfig.from_file(f)
    with pytest.raises(dt.ConfigError, match="not found"):
        dt.SpecConfig.from_file(tmp_path / "missing.toml")
    f.write_text("eagle_topk = [")
    with pytest.raises(dt.ConfigError, match="not valid TOML"):
        dt.SpecConfig.from_file(f)


def test_engine_runs_hooks():
    with pytest.raises(dt.ConfigError):
        dt.Engine(dt.tiny_checkpoint(), dt.SpecConfig(eagle_topk=3, num_steps=2, num_draft_tokens=20))
