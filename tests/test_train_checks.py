"""The trainer's own checks: a corpus too small for its windows is refused before training, and
a run whose loss stops being finite raises instead of writing a checkpoint."""
import pytest

import dsv4_tree as dt
from dsv4_tree.train import TrainConfig, train
from dsv4_tree.train.corpus import check_windows, load_corpus


def test_a_split_too_small_for_a_window_is_refused_before_loading():
    # one file: the training split is empty (every 10th file, the first included, is validation)
    with pytest.raises(dt.InputError, match=r"max_files=1 with seq_len=384: the training split holds 0 bytes"):
        check_windows(1, 384)
    with pytest.raises(dt.InputError, match="max_files=1"):
        train(TrainConfig(steps=1, max_files=1), None, log=lambda m: None)  # refused before out_dir is used
    check_windows(4, 130)  # what tests/test_trained.py trains on
    corpus = load_corpus(4)  # the check reads file sizes; the streams it predicts are the real ones
    assert min(corpus.train.numel(), corpus.val.numel()) >= 130 + 2


def test_a_diverged_run_writes_no_checkpoint(tmp_path):
    """lr = inf turns every weight non-finite in the first update: the loss of step 2 is NaN."""
    cfg = TrainConfig(steps=4, batch=1, seq_len=130, lr=float("inf"), warmup=1, eval_every=2, eval_batches=1,
                      max_files=4, save_every=100)
    with pytest.raises(dt.ConfigError, match=r"TrainConfig.lr=inf: the training loss is nan at step 2.*"
                                             r"no checkpoint was written"):
        train(cfg, tmp_path / "ck", log=lambda m: None)
    assert not (tmp_path / "ck").exists()


def test_every_checkpoint_has_a_finite_validation_loss(tmp_path, monkeypatch):
    """Save points are evaluated (step 2 here, although eval_every is larger); a validation loss
    that is not finite stops the run before its checkpoint, keeping the last finite one."""
    import json

    import dsv4_tree.train.trainer as trainer

    real, calls = trainer.evaluate, []

    def evaluate(*args):  # the real evaluation, then a non-finite one
        calls.append(len(calls))
        return real(*args) if len(calls) == 1 else (float("nan"), 1.0)

    monkeypatch.setattr(trainer, "evaluate", evaluate)
    cfg = TrainConfig(steps=3, batch=1, seq_len=130, warmup=1, eval_every=100, eval_batches=1, max_files=4,
                      save_every=2)
    with pytest.raises(dt.ConfigError, match=r"the validation loss is nan at step 3.*checkpoint of step 2 is kept"):
        train(cfg, tmp_path / "ck", log=lambda m: None)
    meta = json.loads((tmp_path / "ck" / "training.json").read_text())
    assert meta["steps_done"] == 2 and meta["history"]["val_step"] == [2], meta["history"]["val_step"]


def test_train_tiny_that_diverges_exits_2_without_a_checkpoint(tmp_path, capsys):
    """A finite lr the run cannot survive: the weights after the first update give a NaN
    validation loss at step 2, the command's only save point."""
    from dsv4_tree.cli import main

    out = tmp_path / "ck"
    assert main(["train-tiny", "--out", str(out), "--steps", "2", "--batch", "1", "--seq-len", "130",
                 "--max-files", "4", "--eval-every", "2", "--lr", "1e30"]) == 2
    err = capsys.readouterr().err
    assert "ConfigError: TrainConfig.lr=1e+30" in err and "loss is nan at step 2" in err, err
    assert not out.exists()
