"""Retrain a checkpoint's MTP block against its frozen target: `dsv4-tree train-mtp`.

train-tiny's MTP recipe (trainer.py: TrainConfig's steps, batch, windows, learning-rate
schedule, optimizer, loss weight and seed; the block initialised as train-tiny initialises it;
the same training windows and validation set), with the target's weights frozen as the
checkpoint stores them: the MTP rows read the served target's last-layer streams, so the block
learns the model it drafts for. Only the gradient-clipping norm changes scope (the block's
parameters alone). Row convention: trainer.mtp_rows (SGLang's draft-extend rows, none at 0).

The target's files are copied to `out_dir` unless it is the checkpoint itself; its
model.safetensors is rewritten with the new `mtp.0.*` tensors (bf16, as train-tiny stores them)
and every other tensor byte for byte; training.json keeps the target's record and gains an
`mtp_retrain` entry (settings, curves, time); the model card and `mtp_loss_curve.png` follow."""
from __future__ import annotations

import copy
import json
import math
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from ..checkpoint.mtp import MTP_PREFIX, load_mtp, to_checkpoint_names
from ..errors import ConfigError
from ..checkpoint.tiny import random_mtp
from .corpus import batches, check_windows, load_corpus
from .steps import freeze, running_mean, set_lr
from .trainer import StreamCapture, TrainConfig, _check_finite, mtp_rows

COPIED = ("config.json", "generation_config.json", "model.safetensors", "training.json", "loss_curve.png")


def mtp_loss(hf, mtp, capture, seq: torch.Tensor) -> torch.Tensor:
    """CE of the MTP rows of one batch of windows [B, L + 1] against the frozen target's streams."""
    ids, target = seq[:, :-1], seq[:, 1:]
    with torch.no_grad():
        hf(input_ids=ids, use_cache=False)  # fills capture.value: the last layer's output streams
    logits = mtp_rows(hf, mtp, ids, capture.value)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target[:, 1:].reshape(-1))


INITS = ("random", "checkpoint")


def train_mtp(model, cfg: TrainConfig, out_dir, log=print, command: str | None = None, init: str = "random") -> dict:
    """Train an MTP block against `model` (a loaded checkpoint, frozen) and write it into
    `out_dir`. init: "random" (a fresh block, as train-tiny initialises it) or "checkpoint" (the
    checkpoint's own block, trained on: a fine-tune). ConfigError, and nothing written, when a
    loss is not finite or init is neither."""
    if init not in INITS:
        raise ConfigError(f"train_mtp init must be one of {INITS}, got {init!r}")
    check_windows(cfg.max_files, cfg.seq_len)
    torch.manual_seed(cfg.seed)
    corpus = load_corpus(cfg.max_files)
    hf = model.hf.eval()
    restore = freeze(hf)
    mtp = random_mtp(hf.config, seed=cfg.seed).to(dtype=model.dtype)
    if init == "checkpoint":  # the same module, the checkpoint's values (trainable as a fresh one)
        mtp.load_state_dict(load_mtp(model).state_dict())
    mtp.train()
    capture = StreamCapture(hf.model.layers[-1])
    params = [p for p in mtp.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.01)
    g, gv = torch.Generator().manual_seed(cfg.seed), torch.Generator().manual_seed(cfg.seed + 1)
    val_set = [batches(corpus.val, cfg.batch, cfg.seq_len, gv) for _ in range(cfg.eval_batches)]
    hist = {"step": [], "train_mtp_bpb": [], "val_step": [], "val_mtp_bpb": []}
    log(f"[train-mtp] {sum(p.numel() for p in params) / 1e6:.2f}M MTP params ({init} init) against the frozen target "
        f"{model.source}; {corpus.train.numel()} train bytes")
    t0, c0 = time.time(), time.process_time()
    try:
        for step in range(1, cfg.steps + 1):
            set_lr(opt, step, cfg.lr, cfg.warmup, cfg.steps)
            loss = mtp_loss(hf, mtp, capture, batches(corpus.train, cfg.batch, cfg.seq_len, g))
            bpb = float(loss.detach()) / math.log(2)
            _check_finite(cfg, step, "training MTP", bpb, None)
            (cfg.mtp_weight * loss).backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            hist["step"].append(step)
            hist["train_mtp_bpb"].append(bpb)
            if step % cfg.eval_every == 0 or step == cfg.steps:
                v = evaluate(hf, mtp, capture, val_set)
                _check_finite(cfg, step, "validation MTP", v, None)
                hist["val_step"].append(step)
                hist["val_mtp_bpb"].append(v)
                log(f"[train-mtp] step {step}/{cfg.steps} train MTP {bpb:.3f} bpb, val MTP {v:.3f} bpb, "
                    f"{time.time() - t0:.0f}s")
            elif step % 25 == 0:
                log(f"[train-mtp] step {step}/{cfg.steps} train MTP {bpb:.3f} bpb, {time.time() - t0:.0f}s")
    finally:
        capture.handle.remove()
        restore()
    record = {"train_config": asdict(cfg), "init": init, "command": command, "python_version": corpus.python_version,
              "file_list_sha256": corpus.list_sha256, "seconds": round(time.time() - t0, 1),
              "cpu_seconds": round(time.process_time() - c0, 1), "torch_threads": torch.get_num_threads(),
              "rows": "SGLang's draft-extend rows: row p >= 1 pairs x_p with the target's streams at p - 1",
              "final_val_mtp_bpb": hist["val_mtp_bpb"][-1], "history": hist}
    write_mtp(Path(model.source), Path(out_dir), copy.deepcopy(mtp).eval().to(torch.bfloat16), record)
    return hist


@torch.no_grad()
def evaluate(hf, mtp, capture, val_set) -> float:
    mtp.eval()
    total = sum(float(mtp_loss(hf, mtp, capture, seq)) for seq in val_set)
    mtp.train()
    return total / len(val_set) / math.log(2)


def write_mtp(source: Path, out_dir: Path, mtp, record: dict) -> None:
    """out_dir = source's files with `mtp` as its mtp.0.* tensors and `record` in training.json."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if out_dir.resolve() != source.resolve():
        for name in COPIED:
            if (source / name).is_file():
                shutil.copyfile(source / name, out_dir / name)
    path = out_dir / "model.safetensors"
    tensors = {k: v for k, v in load_file(str(path)).items() if not k.startswith(MTP_PREFIX)}
    tensors.update(to_checkpoint_names(mtp))
    mode = path.stat().st_mode & 0o777
    save_file(tensors, str(path) + ".tmp", metadata={"format": "pt"})
    path.with_name(path.name + ".tmp").chmod(mode)  # the file it replaces keeps its permissions
    path.with_name(path.name + ".tmp").replace(path)
    meta_path = out_dir / "training.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    meta["mtp_retrain"] = record
    meta_path.write_text(json.dumps(meta))
    plot_mtp(record["history"], out_dir / "mtp_loss_curve.png")
    if "train_config" in meta and "history" in meta:  # a train-tiny checkpoint: its card says what changed
        from .card import write_model_card

        write_model_card(out_dir)


def plot_mtp(hist, path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    w, s = 25, hist["train_mtp_bpb"]
    ax.plot(hist["step"], running_mean(s, w), label="train (MTP, 25-step mean)")
    ax.plot(hist["val_step"], hist["val_mtp_bpb"], "s--", label="validation (MTP, byte t+2)")
    ax.set_xlabel("step")
    ax.set_ylabel("bits per byte")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
