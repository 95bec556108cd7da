"""The training corpus: the Python standard library's own .py sources, as bytes."""
from __future__ import annotations

import hashlib
import platform
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import InputError

BOS, EOS = 256, 257
VOCAB = 260  # 256 byte values, BOS, EOS, two spare ids
VAL_EVERY = 10  # every 10th file (sorted by name) is held out for validation


@dataclass(frozen=True)
class Corpus:
    train: torch.Tensor  # [n] uint8-valued int64 stream, files joined by EOS
    val: torch.Tensor
    train_files: tuple
    val_files: tuple
    python_version: str
    list_sha256: str  # hash of "name size" lines of every file used


def stdlib_files() -> list:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.glob("*.py") if p.is_file())


def _stream(paths) -> torch.Tensor:
    parts = []
    for p in paths:
        parts.append(torch.tensor(list(p.read_bytes()), dtype=torch.int64))
        parts.append(torch.tensor([EOS]))
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)


def _split(max_files: int | None) -> tuple:
    """(all files, train files, validation files) of the first max_files (None: all)."""
    files = stdlib_files()[:max_files] if max_files else stdlib_files()
    return files, [p for i, p in enumerate(files) if i % VAL_EVERY != 0], \
        [p for i, p in enumerate(files) if i % VAL_EVERY == 0]


def _stream_length(paths) -> int:
    return sum(p.stat().st_size + 1 for p in paths)  # what _stream builds: the bytes, then EOS


def check_windows(max_files: int | None, seq_len: int) -> None:
    """InputError unless both splits of the first max_files files hold a training window of
    seq_len + 1 bytes with room to start it at more than one place (what `batches` draws);
    read from file sizes, before any file is loaded."""
    _, train, val = _split(max_files)
    need = seq_len + 2
    have = {"training": _stream_length(train), "validation": _stream_length(val)}
    short = {k: v for k, v in have.items() if v < need}
    if not short:
        return
    count = len(stdlib_files())
    enough = next((n for n in range(1, count + 1) if all(_stream_length(s) >= need for s in _split(n)[1:])), None)
    hint = f"max_files >= {enough} works at this seq_len" if enough else \
        f"even all {count} files do not: lower seq_len"
    raise InputError(f"max_files={max_files} with seq_len={seq_len}: the "
                     + " and ".join(f"{k} split holds {v} bytes" for k, v in short.items())
                     + f", fewer than the {need} a window of seq_len + 1 bytes needs; {hint}")


def load_corpus(max_files: int | None = None) -> Corpus:
    files, train, val = _split(max_files)
    listing = "\n".join(f"{p.name} {p.stat().st_size}" for p in files).encode()
    return Corpus(_stream(train), _stream(val), tuple(p.name for p in train), tuple(p.name for p in val),
                  platform.python_version(), hashlib.sha256(listing).hexdigest())


def batches(stream: torch.Tensor, batch: int, length: int, g: torch.Generator) -> torch.Tensor:
    """Random windows of length+1 tokens (inputs and next-token targets). [batch, length+1]"""
    starts = torch.randint(0, stream.numel() - length - 1, (batch,), generator=g)
    return torch.stack([stream[s : s + length + 1] for s in starts.tolist()])


def encode(text: str) -> list:
    return list(text.encode("utf-8"))


def decode(ids) -> str:
    return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


def heldout_prompt(length: int, seed: int = 0) -> list:
    """`length` bytes from a held-out (validation) stdlib file, chosen by seed."""
    files = [p for i, p in enumerate(stdlib_files()) if i % VAL_EVERY == 0]
    files = [p for p in files if p.stat().st_size > length + 1] or files
    data = files[seed % len(files)].read_bytes()
    start = (seed * 7919) % max(1, len(data) - length)
    return list(data[start : start + length])
