"""A config.json that is valid JSON but not an object (a number, null, a string, a list) is a
CheckpointError naming the file, wherever it is read: load_model (the target's), load_dspark
(dspark/config.json), the CLI's generate and custom_generate inside transformers' generate."""
from __future__ import annotations

import shutil

import pytest
import torch

import dsv4_tree as dt
from dsv4_tree.checkpoint.dspark import DSparkSettings
from dsv4_tree.checkpoint.dspark_names import load_dspark, write_dspark
from dsv4_tree.checkpoint.tiny import random_dspark, tiny_config, write_random_checkpoint
from dsv4_tree.cli import main

NOT_OBJECTS = ["5", "null", '"deepseek_v4"', "[1, 2]"]
MESSAGE = r"config\.json: a config\.json holds a JSON object, got "


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = write_random_checkpoint(tmp_path_factory.mktemp("cfg") / "target", tiny_config(max_position_embeddings=512))
    write_dspark(d, random_dspark(tiny_config(), DSparkSettings(3, 8, 500, (0, 2))), tiny_config())
    return d


def _copy(src, tmp_path):
    return shutil.copytree(src, tmp_path / "copy")


@pytest.mark.parametrize("text", NOT_OBJECTS)
def test_load_model_names_the_target_config(checkpoint, tmp_path, text):
    d = _copy(checkpoint, tmp_path)
    (d / "config.json").write_text(text)
    with pytest.raises(dt.CheckpointError, match=f"{d / 'config.json'}: .*JSON object, got "):
        dt.load_model(d)


@pytest.mark.parametrize("text", NOT_OBJECTS)
def test_load_dspark_names_the_module_config(checkpoint, tmp_path, text):
    d = _copy(checkpoint, tmp_path)
    model = dt.load_model(d)
    (d / "dspark" / "config.json").write_text(text)
    with pytest.raises(dt.CheckpointError, match=f"{d / 'dspark' / 'config.json'}: .*JSON object, got "):
        load_dspark(model)


@pytest.mark.parametrize("where", ["config.json", "dspark/config.json"])
def test_cli_generate_names_the_file(checkpoint, tmp_path, capsys, where):
    d = _copy(checkpoint, tmp_path)
    (d / where).write_text("null")
    rc = main(["generate", "--checkpoint", str(d), "--drafter", "dspark", "--max-new-tokens", "2", "--prompt-len", "4"])
    err = capsys.readouterr().err
    assert rc == 2 and f"CheckpointError: {d / where}: a config.json holds a JSON object, got NoneType" in err, err


@pytest.mark.parametrize("where", ["config.json", "dspark/config.json"])
def test_custom_generate_names_the_file(checkpoint, tmp_path, where):
    from transformers import DeepseekV4ForCausalLM

    d = _copy(checkpoint, tmp_path)
    if where == "config.json":  # without a dspark/ folder, the target's config.json is where a module would be
        shutil.rmtree(d / "dspark")
    hf = DeepseekV4ForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    (d / where).write_text("5")  # after transformers read it: custom_generate's own reads meet it
    with pytest.raises(dt.CheckpointError, match=f"{d / where}: a config.json holds a JSON object, got int"):
        hf.generate(torch.tensor([[3, 4, 5, 6]]), max_new_tokens=2, do_sample=False, custom_generate=dt.custom_generate)
