"""train-dspark: a DSpark module trained against the frozen shipped target, written as the
checkpoint's dspark/ subfolder, reproducibly, refusing bad settings before any work."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

import dsv4_tree as dt
from dsv4_tree.checkpoint.dspark_names import load_dspark
from dsv4_tree.cli import main


def _run(out, *extra):
    return main(["train-dspark", "--out", str(out), "--steps", "2", "--eval-every", "1", "--max-files", "30",
                 "--anchors", "8", "--batch", "2", *extra])


def test_train_dspark_writes_a_loadable_reproducible_module(tmp_path):
    target = tmp_path / "target"
    shutil.copytree(dt.trained_checkpoint(), target, ignore=shutil.ignore_patterns("dspark"))
    assert _run(target) == 0
    sub = target / "dspark"
    meta = json.loads((sub / "training.json").read_text())
    assert meta["train_config"]["seed"] == 0 and len(meta["file_list_sha256"]) == 64
    assert len(meta["history"]["val_loss"]) == 2 and (sub / "loss_curve.png").stat().st_size > 0
    module = load_dspark(dt.load_model(target))
    assert module.block_size == 5 and module.settings.target_layer_ids == (0, 1, 2)
    again = tmp_path / "again"
    assert _run(again) == 0
    a, b = load_file(str(sub / "model.safetensors")), load_file(str(again / "dspark" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "same seed, same weights"
    assert _run(tmp_path / "other", "--seed", "1") == 0
    c = load_file(str(tmp_path / "other" / "dspark" / "model.safetensors"))
    assert not torch.equal(a["mtp.0.main_proj.weight"], c["mtp.0.main_proj.weight"])


@pytest.mark.parametrize("flags,match", [
    (["--anchors", "1000"], "anchors=1000 exceeds the 378 anchor positions"),
    (["--max-files", "1"], "max_files=1"),
])
def test_bad_settings_exit_2_naming_them(tmp_path, capsys, flags, match):
    assert main(["train-dspark", "--out", str(tmp_path), *flags]) == 2
    assert match in capsys.readouterr().err
    assert not (tmp_path / "dspark").exists()


def test_a_non_finite_lr_is_refused_by_the_parser(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["train-dspark", "--out", str(tmp_path), "--lr", "inf"])
    assert e.value.code == 2 and "--lr" in capsys.readouterr().err
