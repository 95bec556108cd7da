"""Train a tiny DSpark module against the frozen shipped trained target, DeepSpec's recipe.

Per training window the frozen target runs once (features: the output streams of the target
layers averaged over hc, ascending, as SGLang's V4 layer loop and DeepSpec capture them; its
next-byte distributions p_t). Random anchors a get a block
[x_a, noise x (gamma - 1)] whose rows see the context K=V of positions a - W .. a - 1 and the
whole block (drafters/dspark_rows.py, the drafter's own functions); the Markov head is
teacher-forced (prev = x_a .. x_{a + gamma - 1}). Loss per block position k, weighted by
exp(-(k - 1) / decay): 0.1 CE(x_{a+k}) + 0.9 ||p_d - p_t||_1 + 1.0 BCE(c_k, 1 - ||p_d - p_t||_1 / 2)
(the label detached). Seeded; CPU."""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..checkpoint.dspark import DSparkSettings
from ..checkpoint.dspark_names import write_dspark
from ..checkpoint.tiny import random_dspark
from ..drafters.dspark_rows import block_ids, block_rows, context_rows, confidences, markov_logits
from ..errors import ConfigError
from .corpus import batches, check_windows, load_corpus
from .steps import freeze, running_mean, set_lr


@dataclass
class DSparkTrainConfig:
    steps: int = 800
    batch: int = 4
    seq_len: int = 384
    anchors: int = 64  # per window
    lr: float = 3e-3
    warmup: int = 50
    seed: int = 0
    eval_every: int = 100
    eval_batches: int = 4
    block_size: int = 5  # gamma
    markov_rank: int = 32
    noise_token_id: int = 258  # a spare id of the byte vocabulary (train/corpus.py)
    target_layer_ids: tuple = (0, 1, 2)  # their outputs: the inputs of layers 1-3
    loss_decay: float = 4.0
    max_files: int | None = None


class FeatureCapture:
    """Forward hooks on the target layers: their output streams averaged over hc, [B, L, hidden]
    each, concatenated in ascending layer order."""

    def __init__(self, hf, layer_ids):
        self.layer_ids, self.seen = tuple(sorted(layer_ids)), {}
        self.handles = [hf.model.layers[i].register_forward_hook(self._hook(i)) for i in self.layer_ids]

    def _hook(self, i):
        def hook(module, args, output):
            self.seen[i] = output.mean(2)
        return hook

    def features(self) -> torch.Tensor:
        return torch.cat([self.seen[i] for i in self.layer_ids], -1)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def anchor_index(anchors: torch.Tensor, length: int, window: int, gamma: int) -> torch.Tensor:
    """anchors [B, A] positions in windows of `length` rows laid out back to back -> keys of every
    block row [B * A * gamma, window + gamma]: context rows a - window .. a - 1 of its own window,
    then its own block's rows (after the B * length context rows; gamma: rows per block,
    DSparkSettings.block_rows)."""
    b, a = anchors.shape
    j = torch.arange(window)
    ctx = anchors.unsqueeze(-1) - window + j  # [B, A, W]
    ctx = torch.where(ctx >= 0, ctx + (torch.arange(b) * length).view(b, 1, 1), torch.full_like(ctx, -1))
    own = b * length + torch.arange(b * a).view(b, a, 1) * gamma + torch.arange(gamma)
    return torch.cat([ctx, own], -1).reshape(b * a, -1).repeat_interleave(gamma, dim=0)


def dspark_losses(model, module, capture, seq: torch.Tensor, g: torch.Generator, cfg: DSparkTrainConfig):
    """-> (total loss, per-position CE [gamma], per-position top-1 agreement with the target [gamma])."""
    ids = seq[:, :-1]
    b, length = ids.shape
    gamma, window = cfg.block_size, model.window
    with torch.no_grad():
        target_logits = model.hf(input_ids=ids, use_cache=False).logits  # [B, L, V]
        feats = capture.features()  # [B, L, L_t * d]
    anchors = torch.stack([torch.randperm(length - gamma - 1, generator=g)[: cfg.anchors] + 1 for _ in range(b)])
    tables = context_rows(model, module, feats.reshape(b * length, -1), torch.arange(length).repeat(b))
    pos = anchors.reshape(-1)
    rows = torch.arange(b).repeat_interleave(cfg.anchors)
    blk = block_rows(model, module, block_ids(module, ids[rows, pos]), pos, tables,
                     anchor_index(anchors, length, window, module.settings.block_rows))
    k = torch.arange(gamma)
    prev = ids[rows.unsqueeze(1), pos.unsqueeze(1) + k]  # x_a .. x_{a + gamma - 1}: teacher forcing
    labels = seq[rows.unsqueeze(1), pos.unsqueeze(1) + k + 1]
    logits = markov_logits(module, blk.base, prev)  # [BA, gamma, V]
    p_t = torch.softmax(target_logits[rows.unsqueeze(1), pos.unsqueeze(1) + k].float(), -1)
    log_d = torch.log_softmax(logits, -1)
    ce = F.nll_loss(log_d.reshape(-1, log_d.shape[-1]), labels.reshape(-1), reduction="none").view(-1, gamma)
    l1 = (log_d.exp() - p_t).abs().sum(-1)  # [BA, gamma]
    conf = confidences(module, blk.hidden, prev).clamp(1e-6, 1 - 1e-6)
    bce = F.binary_cross_entropy(conf, (1 - l1 / 2).detach(), reduction="none")
    w = torch.exp(-k.float() / cfg.loss_decay)
    total = ((0.1 * ce + 0.9 * l1 + bce).mean(0) * w).sum() / w.sum()
    agree = (logits.argmax(-1) == p_t.argmax(-1)).float().mean(0)
    return total, ce.detach().mean(0), agree


def check_config(cfg: DSparkTrainConfig) -> None:
    """Everything about the settings that needs no target (ConfigError naming the field)."""
    for name in ("steps", "batch", "anchors", "block_size", "markov_rank", "eval_every", "eval_batches", "warmup"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"DSparkTrainConfig.{name} must be >= 1, got {getattr(cfg, name)}")
    for name in ("lr", "loss_decay"):
        if not (math.isfinite(getattr(cfg, name)) and getattr(cfg, name) > 0):
            raise ConfigError(f"DSparkTrainConfig.{name} must be a finite number > 0, got {getattr(cfg, name)}")
    if cfg.anchors > cfg.seq_len - cfg.block_size - 1:
        raise ConfigError(f"DSparkTrainConfig.anchors={cfg.anchors} exceeds the {cfg.seq_len - cfg.block_size - 1} "
                          f"anchor positions a window of seq_len={cfg.seq_len} has")


def _check(cfg: DSparkTrainConfig, model) -> None:
    check_config(cfg)
    DSparkSettings.from_config(_settings(cfg).to_config(), model.config, "DSparkTrainConfig")


def _settings(cfg: DSparkTrainConfig) -> DSparkSettings:
    return DSparkSettings(cfg.block_size, cfg.markov_rank, cfg.noise_token_id, tuple(cfg.target_layer_ids))


def train_dspark(model, cfg: DSparkTrainConfig, out_dir: Path, log=print) -> dict:
    """Train against `model` (a loaded target, frozen) and write `out_dir/dspark/` with training.json
    and loss_curve.png. ConfigError, and nothing written, when a loss is not finite."""
    _check(cfg, model)
    check_windows(cfg.max_files, cfg.seq_len)
    torch.manual_seed(cfg.seed)
    corpus = load_corpus(cfg.max_files)
    hf = model.hf.eval()
    restore = freeze(hf)
    module = random_dspark(model.config, _settings(cfg), seed=cfg.seed)
    for name, p in module.named_parameters():  # small-init scales, as the target's training
        if p.dim() == 2:
            p.data.mul_(0.5)
    module.train()
    capture = FeatureCapture(hf, cfg.target_layer_ids)
    params = list(module.parameters())
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.01)
    g, ga = torch.Generator().manual_seed(cfg.seed), torch.Generator().manual_seed(cfg.seed + 7)
    gv = torch.Generator().manual_seed(cfg.seed + 1)
    val_set = [batches(corpus.val, cfg.batch, cfg.seq_len, gv) for _ in range(cfg.eval_batches)]
    hist = {"step": [], "train_loss": [], "val_step": [], "val_loss": [], "val_ce_by_position": [],
            "val_agree_by_position": []}
    n_params = sum(p.numel() for p in params)
    log(f"[train-dspark] {n_params / 1e6:.2f}M DSpark params, gamma {cfg.block_size}, rank {cfg.markov_rank}, "
        f"target layers {list(cfg.target_layer_ids)}; {corpus.train.numel()} train bytes")
    t0, c0 = time.time(), time.process_time()
    try:
        for step in range(1, cfg.steps + 1):
            set_lr(opt, step, cfg.lr, cfg.warmup, cfg.steps)
            loss, _, _ = dspark_losses(model, module, capture, batches(corpus.train, cfg.batch, cfg.seq_len, g), ga, cfg)
            if not math.isfinite(float(loss.detach())):
                raise ConfigError(f"DSparkTrainConfig.lr={cfg.lr}: the training loss is {float(loss.detach())} at step {step}; "
                                  "training diverged and nothing was written (use a smaller lr)")
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            hist["step"].append(step)
            hist["train_loss"].append(float(loss.detach()))
            if step % cfg.eval_every == 0 or step == cfg.steps:
                v, ce, agree = evaluate(model, module, capture, val_set, cfg)
                if not math.isfinite(v):
                    raise ConfigError(f"DSparkTrainConfig.lr={cfg.lr}: the validation loss is {v} at step {step}; "
                                      "nothing was written")
                hist["val_step"].append(step)
                hist["val_loss"].append(v)
                hist["val_ce_by_position"].append(ce)
                hist["val_agree_by_position"].append(agree)
                log(f"[train-dspark] step {step}/{cfg.steps} train {hist['train_loss'][-1]:.3f}, val {v:.3f}, val agreement "
                    f"by position {' '.join(f'{a:.2f}' for a in agree)}, {time.time() - t0:.0f}s")
            elif step % 25 == 0:
                log(f"[train-dspark] step {step}/{cfg.steps} train {hist['train_loss'][-1]:.3f}, {time.time() - t0:.0f}s")
    finally:
        capture.remove()
        restore()
    meta = {"train_config": asdict(cfg), "python_version": corpus.python_version,
            "file_list_sha256": corpus.list_sha256, "params": n_params, "seconds": round(time.time() - t0, 1),
            "cpu_seconds": round(time.process_time() - c0, 1), "torch_threads": torch.get_num_threads(),
            "final_val_loss": hist["val_loss"][-1], "val_agree_by_position": hist["val_agree_by_position"][-1],
            "history": hist}

    def card(folder: Path) -> None:
        (folder / "training.json").write_text(json.dumps(meta))
        plot_dspark(hist, folder / "loss_curve.png")

    write_dspark(out_dir, module.eval().to(torch.float32), model.config, extra=card)
    return hist


@torch.no_grad()
def evaluate(model, module, capture, val_set, cfg: DSparkTrainConfig) -> tuple:
    """Mean loss, per-position CE (nats) and top-1 agreement with the target on held-out windows
    (anchors drawn from a fixed seed: the same every evaluation)."""
    module.eval()
    g = torch.Generator().manual_seed(cfg.seed + 11)
    out = [dspark_losses(model, module, capture, seq, g, cfg) for seq in val_set]
    module.train()
    n = len(out)
    return (sum(float(o[0]) for o in out) / n, [float(x) for x in sum(o[1] for o in out) / n],
            [float(x) for x in sum(o[2] for o in out) / n])


def plot_dspark(hist, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
    w, s = 25, hist["train_loss"]
    ax.plot(hist["step"], running_mean(s, w), label="train (25-step mean)")
    ax.plot(hist["val_step"], hist["val_loss"], "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("DSpark loss (0.1 CE + 0.9 L1 + BCE)")
    ax.legend()
    for k in range(len(hist["val_agree_by_position"][0])):
        bx.plot(hist["val_step"], [a[k] for a in hist["val_agree_by_position"]], "o-", label=f"position {k + 1}")
    bx.set_xlabel("step")
    bx.set_ylabel("held-out top-1 agreement with the target")
    bx.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
