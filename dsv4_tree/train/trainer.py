"""Train a small DeepSeek-V4 (every layer type, hash + routed MoE) jointly with its MTP block
on the standard library's sources, byte-level. CPU-only, seeded.

Loss = CE(main next byte) + mtp_weight * CE(MTP): the MTP row at position p >= 1 takes byte
x_p and the main model's residual streams at p-1 and predicts x_{p+1} (i.e. from the streams at
t and the embedding of x_{t+1}, predict x_{t+2}); no row pairs x_0 with anything, as in
SGLang's draft-extend (design_notes/mtp-drafter.md). `train_mtp` (mtp_trainer.py) retrains the
MTP block alone against a frozen target with the same recipe."""
from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..checkpoint.mtp import MtpBlock, add_mtp_to_checkpoint
from ..checkpoint.tiny import random_model, random_mtp, tiny_config
from ..errors import ConfigError
from .corpus import BOS, EOS, VOCAB, batches, check_windows, load_corpus
from .steps import running_mean, set_lr

BYTE_MODEL = dict(
    vocab_size=VOCAB, hidden_size=128, moe_intermediate_size=96, num_attention_heads=4, head_dim=32,
    q_lora_rank=64, o_lora_rank=32, o_groups=2, sliding_window=64, index_n_heads=4, index_head_dim=16,
    index_topk=16, n_routed_experts=4, num_experts_per_tok=2, max_position_embeddings=4096,
    bos_token_id=BOS, eos_token_id=EOS,
)


@dataclass
class TrainConfig:
    steps: int = 2000
    batch: int = 8
    seq_len: int = 384  # 3 x 128: C128 entries occur in every window
    lr: float = 3e-3
    warmup: int = 100
    mtp_weight: float = 0.3
    seed: int = 0
    eval_every: int = 250
    eval_batches: int = 8
    max_files: int | None = None  # limit the corpus (CI smoke runs)
    save_every: int = 500


def mtp_rows(model, mtp: MtpBlock, ids: torch.Tensor, main_streams: torch.Tensor) -> torch.Tensor:
    """MTP logits of the rows at positions 1 .. L-1 of a batch (row p: x_p with the main streams
    at p - 1; dense causal sliding window over those rows). ids [B, L] -> [B, L - 1, V]"""
    hf = model.model
    ids = ids[:, 1:]
    length = ids.shape[1]
    emb = hf.embed_tokens(ids)
    x = mtp.e_proj(mtp.enorm(emb)).unsqueeze(2) + mtp.h_proj(mtp.hnorm(main_streams[:, :-1]))
    pos = torch.arange(1, length + 1).unsqueeze(0)
    pe = {label: hf.rotary_emb(emb, position_ids=pos, layer_type=label) for label in ("main", "compress")}
    i = torch.arange(length)
    ok = (i.view(-1, 1) >= i.view(1, -1)) & (i.view(-1, 1) - i.view(1, -1) < model.config.sliding_window)
    mask = torch.zeros(1, 1, length, length).masked_fill(~ok, float("-inf"))
    h = mtp.decoder(x, input_ids=ids, position_embeddings=pe, position_ids=pos, attention_mask=mask)
    return model.lm_head(mtp.norm(mtp.hc_head(h)))


class StreamCapture:
    """Forward hook on the last decoder layer: its output streams [B, L, hc, hidden]."""

    def __init__(self, layer):
        self.value = None
        self.handle = layer.register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        self.value = output


def losses(model, mtp, capture, seq: torch.Tensor):
    ids, target = seq[:, :-1], seq[:, 1:]
    logits = model(input_ids=ids, use_cache=False).logits
    main = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
    mlog = mtp_rows(model, mtp, ids, capture.value)  # rows 1 .. L-1 (none at 0: no main streams before it)
    mtp_loss = F.cross_entropy(mlog.reshape(-1, mlog.shape[-1]), target[:, 1:].reshape(-1))
    return main, mtp_loss


def _check_finite(cfg: TrainConfig, step: int, what: str, bpb: float, saved: int | None) -> None:
    """A diverged run writes no checkpoint: ConfigError naming lr, before any save."""
    if not math.isfinite(bpb):
        kept = f"the checkpoint of step {saved} is kept" if saved else "no checkpoint was written"
        raise ConfigError(f"TrainConfig.lr={cfg.lr}: the {what} loss is {bpb} at step {step}, training diverged; "
                          f"{kept} (use a smaller lr)")


def train(cfg: TrainConfig, out_dir: Path, log=print) -> dict:
    """Train, evaluate and save at every save point; ConfigError (and no checkpoint written
    past the last finite one) as soon as a training or validation loss is not finite."""
    check_windows(cfg.max_files, cfg.seq_len)
    torch.manual_seed(cfg.seed)
    corpus = load_corpus(cfg.max_files)
    config = tiny_config(**BYTE_MODEL)
    model = random_model(config, seed=cfg.seed)
    for name, p in model.named_parameters():  # start from standard small-init scales
        if p.dim() == 2 and "embed" not in name:
            p.data.mul_(0.5)
    mtp = random_mtp(config, seed=cfg.seed)
    model.train()
    mtp.train()
    capture = StreamCapture(model.model.layers[-1])
    params = [p for p in list(model.parameters()) + list(mtp.parameters()) if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.01)
    g = torch.Generator().manual_seed(cfg.seed)
    gv = torch.Generator().manual_seed(cfg.seed + 1)
    val_set = [batches(corpus.val, cfg.batch, cfg.seq_len, gv) for _ in range(cfg.eval_batches)]
    history = {"step": [], "train_bpb": [], "train_mtp_bpb": [], "val_step": [], "val_bpb": [], "val_mtp_bpb": []}
    n_params = sum(p.numel() for p in model.parameters())
    n_mtp = sum(p.numel() for p in mtp.parameters())
    log(f"[train] {n_params / 1e6:.2f}M main + {n_mtp / 1e6:.2f}M MTP params; corpus {corpus.train.numel()} train / "
        f"{corpus.val.numel()} val bytes from {len(corpus.train_files) + len(corpus.val_files)} files (Python "
        f"{corpus.python_version})")
    t0, saved = time.time(), None
    for step in range(1, cfg.steps + 1):
        set_lr(opt, step, cfg.lr, cfg.warmup, cfg.steps)
        main, mtp_loss = losses(model, mtp, capture, batches(corpus.train, cfg.batch, cfg.seq_len, g))
        bpb, mtp_bpb = float(main.detach()) / math.log(2), float(mtp_loss.detach()) / math.log(2)
        _check_finite(cfg, step, "training", bpb, saved)
        _check_finite(cfg, step, "training MTP", mtp_bpb, saved)
        (main + cfg.mtp_weight * mtp_loss).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        history["step"].append(step)
        history["train_bpb"].append(bpb)
        history["train_mtp_bpb"].append(mtp_bpb)
        save_now = step % cfg.save_every == 0 or step == cfg.steps
        if step % cfg.eval_every == 0 or save_now:  # every checkpoint has its own validation loss
            v, vm = evaluate(model, mtp, capture, val_set)
            _check_finite(cfg, step, "validation", v, saved)
            _check_finite(cfg, step, "validation MTP", vm, saved)
            history["val_step"].append(step)
            history["val_bpb"].append(v)
            history["val_mtp_bpb"].append(vm)
            log(f"[train] step {step}/{cfg.steps} train {history['train_bpb'][-1]:.3f} bpb, val {v:.3f} bpb, "
                f"val MTP {vm:.3f} bpb, {time.time() - t0:.0f}s")
        elif step % 25 == 0:
            log(f"[train] step {step}/{cfg.steps} train {history['train_bpb'][-1]:.3f} bpb "
                f"(MTP {history['train_mtp_bpb'][-1]:.3f}), {time.time() - t0:.0f}s")
        if save_now:
            save(model, mtp, out_dir, cfg, corpus, history, n_params, n_mtp, time.time() - t0)
            saved = step
    capture.handle.remove()
    return history


@torch.no_grad()
def evaluate(model, mtp, capture, val_set) -> tuple:
    model.eval()
    mtp.eval()
    m = t = 0.0
    for seq in val_set:
        a, b = losses(model, mtp, capture, seq)
        m, t = m + float(a), t + float(b)
    model.train()
    mtp.train()
    return m / len(val_set) / math.log(2), t / len(val_set) / math.log(2)


def save(model, mtp, out_dir: Path, cfg: TrainConfig, corpus, history, n_params, n_mtp, seconds) -> None:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    import copy

    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(str(out_dir), safe_serialization=True)
    add_mtp_to_checkpoint(out_dir, copy.deepcopy(mtp).to(torch.bfloat16))
    meta = {
        "train_config": asdict(cfg), "python_version": corpus.python_version, "file_list_sha256": corpus.list_sha256,
        "train_files": list(corpus.train_files), "val_files": list(corpus.val_files), "params_main": n_params,
        "params_mtp": n_mtp, "steps_done": history["step"][-1], "seconds": round(seconds, 1),
        "final_train_bpb": history["train_bpb"][-1], "final_val_bpb": history["val_bpb"][-1] if history["val_bpb"] else None,
        "final_val_mtp_bpb": history["val_mtp_bpb"][-1] if history["val_mtp_bpb"] else None, "history": history,
    }
    (out_dir / "training.json").write_text(json.dumps(meta))
    plot_history(history, out_dir / "loss_curve.png")
    from .card import write_model_card

    write_model_card(out_dir)


def plot_history(history, path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[train] matplotlib missing: no loss curve written", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    w = 25
    s = history["train_bpb"]
    smooth = running_mean(s, w)
    ax.plot(history["step"], smooth, label="train (main, 25-step mean)")
    ax.plot(history["val_step"], history["val_bpb"], "o-", label="validation (main)")
    ax.plot(history["val_step"], history["val_mtp_bpb"], "s--", label="validation (MTP, byte t+2)")
    ax.set_xlabel("step")
    ax.set_ylabel("bits per byte")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
