"""The CLI's training commands: train-tiny (the byte-level target + MTP), train-mtp (the MTP block
again, against a frozen target) and train-dspark (a DSpark drafter against a frozen target)."""
from __future__ import annotations

import json

import torch

from .checkpoint.tiny import trained_checkpoint
from .cli_args import int_at_least, real_in, seed_value
from .model.adapter import load_model
from .train.mtp_trainer import INITS


def cmd_train_dspark(args) -> int:
    from pathlib import Path

    from .train.corpus import check_windows
    from .train.dspark_trainer import DSparkTrainConfig, check_config, train_dspark

    torch.set_num_threads(args.threads)
    cfg = DSparkTrainConfig(steps=args.steps, batch=args.batch, anchors=args.anchors, lr=args.lr, seed=args.seed,
                            eval_every=args.eval_every, block_size=args.block_size, markov_rank=args.markov_rank,
                            max_files=args.max_files)
    check_config(cfg)  # before the target is loaded
    check_windows(cfg.max_files, cfg.seq_len)
    model = load_model(args.checkpoint or trained_checkpoint())
    hist = train_dspark(model, cfg, Path(args.out), log=lambda m: print(m, flush=True))
    print(json.dumps({"out": str(Path(args.out) / "dspark"), "final_val_loss": hist["val_loss"][-1],
                      "val_agree_by_position": hist["val_agree_by_position"][-1]}))
    return 0


def _add_against_target(t, eval_every: int, threads: int) -> None:
    """The flags train-mtp and train-dspark share: both train a drafter against a frozen target."""
    t.add_argument("--checkpoint", default=None, help="the frozen target (default: the shipped trained checkpoint)")
    t.add_argument("--lr", type=real_in(0.0, float("inf"), low_open=True), default=3e-3,
                   help="peak learning rate (warmup, cosine decay); finite, > 0")
    t.add_argument("--eval-every", type=int_at_least(1), default=eval_every, help="validation interval (steps)")
    t.add_argument("--threads", type=int_at_least(1), default=threads, help="torch CPU threads")
    t.add_argument("--max-files", type=int_at_least(1), default=None, help="use only the first N stdlib files")


def add_train_dspark(sub) -> None:
    t = sub.add_parser("train-dspark", help="train a small DSpark drafter against a frozen target (default: the "
                                            "shipped trained checkpoint) on the stdlib sources (CPU)")
    t.add_argument("--out", required=True, help="directory to write the module into, as its dspark/ subfolder "
                                                "(model.safetensors, config.json, training.json, loss_curve.png)")
    t.add_argument("--steps", type=int_at_least(1), default=800, help="optimizer steps")
    t.add_argument("--batch", type=int_at_least(1), default=4, help="training windows per step")
    t.add_argument("--anchors", type=int_at_least(1), default=64, help="blocks per window (at most seq_len - gamma - 1)")
    t.add_argument("--block-size", type=int_at_least(1), default=5, help="gamma: drafts per block")
    t.add_argument("--markov-rank", type=int_at_least(1), default=32, help="rank r of the Markov head")
    t.add_argument("--seed", type=seed_value, default=0, help="seed for weights, windows and anchors")
    _add_against_target(t, eval_every=100, threads=1)
    t.set_defaults(func=cmd_train_dspark)


def cmd_train_tiny(args) -> int:
    from pathlib import Path

    from .train import TrainConfig, train

    cfg = TrainConfig(steps=args.steps, batch=args.batch, seq_len=args.seq_len, lr=args.lr, seed=args.seed,
                      eval_every=args.eval_every, max_files=args.max_files)
    hist = train(cfg, Path(args.out), log=lambda m: print(m, flush=True))
    print(json.dumps({"out": args.out, "final_train_bpb": hist["train_bpb"][-1],
                      "final_val_bpb": hist["val_bpb"][-1] if hist["val_bpb"] else None}))
    return 0


def add_train_commands(sub) -> None:
    t = sub.add_parser("train-tiny", help="train the small byte-level DeepSeek-V4 + MTP on the stdlib sources (CPU)")
    t.add_argument("--out", required=True, help="output checkpoint directory (HF layout + mtp.* + training.json)")
    t.add_argument("--steps", type=int_at_least(1), default=2000, help="optimizer steps")
    t.add_argument("--batch", type=int_at_least(1), default=8, help="sequences per step")
    t.add_argument("--seq-len", type=int_at_least(1), default=384, help="bytes per sequence (several times 128)")
    t.add_argument("--lr", type=real_in(0.0, float("inf"), low_open=True), default=3e-3,
                   help="peak learning rate (warmup, cosine decay); finite, > 0. A run whose loss stops being "
                        "finite stops with an error and writes no checkpoint past the last finite one")
    t.add_argument("--seed", type=seed_value, default=0, help="seed for weights and batches (0 to 2^63-1)")
    t.add_argument("--eval-every", type=int_at_least(1), default=250, help="validation interval (steps)")
    t.add_argument("--max-files", type=int_at_least(1), default=None,
                   help="use only the first N stdlib files (smoke runs); both splits (every 10th file is "
                        "validation) must hold a --seq-len window, checked before training")
    t.set_defaults(func=cmd_train_tiny)
    add_train_dspark(sub)
    add_train_mtp(sub)


def cmd_train_mtp(args) -> int:
    import shlex
    import sys
    from pathlib import Path

    from .train.corpus import check_windows
    from .train.mtp_trainer import train_mtp
    from .train.trainer import TrainConfig

    torch.set_num_threads(args.threads)
    cfg = TrainConfig(steps=args.steps, batch=args.batch, seq_len=args.seq_len, lr=args.lr, seed=args.seed,
                      warmup=args.warmup, eval_every=args.eval_every, max_files=args.max_files)
    check_windows(cfg.max_files, cfg.seq_len)  # before the target is loaded
    model = load_model(args.checkpoint or trained_checkpoint())
    command = "dsv4-tree " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:2] == ["train-mtp"] else None
    hist = train_mtp(model, cfg, Path(args.out), log=lambda m: print(m, flush=True), command=command, init=args.init)
    print(json.dumps({"out": args.out, "final_val_mtp_bpb": hist["val_mtp_bpb"][-1]}))
    return 0


def add_train_mtp(sub) -> None:
    t = sub.add_parser("train-mtp", help="retrain a checkpoint's MTP block against its frozen target (default: the "
                                         "shipped trained checkpoint) with train-tiny's recipe (CPU)")
    t.add_argument("--out", required=True, help="directory to write the checkpoint with the new mtp.0.* block into "
                                                "(the target's files are copied there unless it is the checkpoint)")
    t.add_argument("--steps", type=int_at_least(1), default=2000, help="optimizer steps")
    t.add_argument("--batch", type=int_at_least(1), default=8, help="sequences per step")
    t.add_argument("--seq-len", type=int_at_least(1), default=384, help="bytes per sequence")
    t.add_argument("--seed", type=seed_value, default=0, help="seed for the block's weights and the batches")
    t.add_argument("--warmup", type=int_at_least(1), default=100, help="learning-rate warmup steps")
    t.add_argument("--init", choices=INITS, default="random",
                   help="start from a fresh block (train-tiny's initialisation) or from the checkpoint's own block")
    _add_against_target(t, eval_every=250, threads=2)
    t.set_defaults(func=cmd_train_mtp)
