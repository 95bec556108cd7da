"""Command-line argument types and the checks run right after parsing: every bad value exits 2
with a message naming its flag before any model is loaded or any step runs."""
from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from .config import SpecConfig
from .errors import Dsv4TreeError

SEED_MAX = 2**63 - 1  # torch.Generator.manual_seed takes 64 bits; the trainer also seeds with seed + 1


def int_at_least(low: int, high: int | None = None):
    """argparse type: an int >= low (and <= high when given); argparse names the flag."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if value < low or (high is not None and value > high):
            bound = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value
    parse.__name__ = f"int >= {low}"
    return parse


def real_in(low: float, high: float, low_open: bool = False):
    """argparse type: a finite float in [low, high] ((low, high] with low_open); high may be inf,
    which is never accepted itself."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
        inside = (low < value if low_open else low <= value) and value <= high
        if not (math.isfinite(value) and inside):
            close = ")" if math.isinf(high) else "]"
            opening = "(" if low_open else "["
            raise argparse.ArgumentTypeError(f"must be a finite number in {opening}{low}, {high}{close}, got {text}")
        return value
    parse.__name__ = "float"
    return parse


seed_value = int_at_least(0, SEED_MAX)


def spec_preset(text: str) -> SpecConfig:
    """argparse type for --spec: the TOML preset read and checked (SpecConfig.from_file)."""
    try:
        return SpecConfig.from_file(text)
    except Dsv4TreeError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def prompt_text(text: str) -> str:
    """argparse type for --prompt-text: at least one character (one byte-level token)."""
    if not text:
        raise argparse.ArgumentTypeError("must hold at least one character (a request needs a token)")
    return text


def token_ids(text: str) -> list:
    """argparse type for --prompt: comma-separated token ids, at least one, each >= 0."""
    try:
        ids = [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated integer token ids, got {text!r}") from None
    if any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"token ids must be >= 0, got {text!r}")
    return ids


def _check_output_file(ap: argparse.ArgumentParser, flag: str, value: str) -> None:
    path = Path(value)
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        ap.error(f"{flag} {value!r} is a directory; give a file path")
    if not parent.is_dir():
        ap.error(f"{flag} {value!r}: directory {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK):
        ap.error(f"{flag} {value!r}: directory {str(parent)!r} is not writable")


def check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What no single flag's type can check: combinations, and paths that must exist."""
    if getattr(args, "mask_mode", None) is not None and not args.tensors_out:
        ap.error("--mask-mode sets the layout of the tensors --tensors-out saves: give --tensors-out FILE.pt too")
    if getattr(args, "prompt", None) is not None and args.prompt_text is not None:
        ap.error("--prompt and --prompt-text each give the prompt: give one")
    if getattr(args, "tensors_out", None):
        _check_output_file(ap, "--tensors-out", args.tensors_out)
    if getattr(args, "ep_implementation", None) is not None and args.ep is None:
        ap.error(f"--ep-implementation {args.ep_implementation} applies to expert parallelism: give --ep N too "
                 "(--tp alone has no token dispatch)")
    if getattr(args, "tp", None) is not None and args.ep is not None and args.tp != args.ep:
        ap.error(f"--ep {args.ep} needs --tp {args.ep} or no --tp: transformers' expert parallelism runs over the "
                 f"ranks of the tensor plan (ep_size == tp_size), got --tp {args.tp}")
    if args.command == "train-tiny":
        from .train.corpus import check_windows

        try:
            check_windows(args.max_files, args.seq_len)
        except Dsv4TreeError as exc:
            ap.error(f"--max-files / --seq-len: {exc}")
