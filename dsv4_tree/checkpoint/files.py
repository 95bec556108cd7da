"""A checkpoint directory's files: which shards, what quantisation, tensors by prefix, and
replacing a directory whole when writing one.

Used before handing a directory to transformers (to refuse, with the file or key named, what we
cannot serve) and to read the `mtp.*` tensors transformers drops, dequantising FP8 / FP4 pairs
on the CPU."""
from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import CheckpointError
from .quant import dequantize_weight

INDEX_FILE = "model.safetensors.index.json"
QUANT_METHODS = ("fp8",)  # transformers' fine-grained FP8 (block scales; FP8 or FP4 experts)
EXPERT_DTYPES = ("fp8", "fp4")
SCALE_FMTS = ("float", "ue8m0")
SCALE_SUFFIXES = ("_scale_inv", "_scale")  # `x.weight_scale_inv`; some releases name it `x.scale`


def read_config(path: Path) -> dict:
    cfg_file = Path(path) / "config.json"
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{cfg_file}: cannot read it as JSON ({e})") from e
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{cfg_file}: a config.json holds a JSON object, got {type(cfg).__name__} "
                              f"({json.dumps(cfg)[:40]})")
    return cfg


def quantization(path: Path) -> dict | None:
    """config.json's quantization_config, validated against what we can serve (None: dense)."""
    cfg_file = Path(path) / "config.json"
    q = read_config(path).get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise CheckpointError(f"{cfg_file}: quantization_config must be an object, got {type(q).__name__}")
    method = q.get("quant_method")
    if method not in QUANT_METHODS:
        raise CheckpointError(f"{cfg_file}: quantization_config.quant_method is {method!r}; supported: {QUANT_METHODS}")
    for key, allowed in (("expert_dtype", EXPERT_DTYPES), ("scale_fmt", SCALE_FMTS)):
        if key in q and q[key] not in allowed:
            raise CheckpointError(f"{cfg_file}: quantization_config.{key} is {q[key]!r}; supported: {allowed}")
    block = q.get("weight_block_size")
    if block is not None and (not isinstance(block, list) or len(block) != 2 or min(block) <= 0):
        raise CheckpointError(f"{cfg_file}: quantization_config.weight_block_size must be two positive ints, got {block!r}")
    return q


def shard_files(path: Path) -> list[Path]:
    """The weight files: those the index names (every one must exist), else every *.safetensors."""
    path = Path(path)
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index with a weight_map ({e})") from e
        files = {}
        for key, fname in weight_map.items():
            files.setdefault(fname, key)
        for fname, key in files.items():
            if not (path / fname).is_file():
                raise CheckpointError(f"{index} names shard {fname!r} (e.g. for {key!r}) but {path / fname} is missing")
        return [path / f for f in sorted(files)]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path} has no *.safetensors weights and no {INDEX_FILE}")
    return files


def release_complete(path: Path) -> bool:
    """Whether a directory holds a config, an index and every shard the index names."""
    path = Path(path)
    if not ((path / "config.json").is_file() and (path / INDEX_FILE).is_file()):
        return False
    try:
        shard_files(path)
    except CheckpointError:
        return False
    return True


@contextlib.contextmanager
def replaced_directory(directory: Path):
    """Yield a fresh folder beside `directory`; when the block succeeds it replaces `directory`
    whole (a half-written checkpoint is never left under the final name)."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=directory.parent))
    try:
        yield tmp
        if directory.exists():
            shutil.rmtree(directory)
        tmp.rename(directory)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def _scale_name(name: str, names) -> str | None:
    stem = name[: -len(".weight")] if name.endswith(".weight") else None
    for cand in (name + SCALE_SUFFIXES[0], (stem + ".scale") if stem else None):
        if cand is not None and cand in names:
            return cand
    return None


def read_tensors(path: Path, prefix: str, dtype=torch.float32) -> dict:
    """Every tensor whose name starts with `prefix`, dense: quantised weights are multiplied by
    their scale grids (FP8 e4m3, or FP4 when stored int8-packed); scale tensors are consumed."""
    raw = {}
    for f in shard_files(path):
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                if k.startswith(prefix):
                    raw[k] = fh.get_tensor(k)
    out, used = {}, set()
    for name in sorted(raw):
        if name in used:
            continue
        scale = _scale_name(name, raw)
        t = raw[name]
        if scale is not None:
            out[name] = dequantize_weight(name, t, raw[scale], dtype)
            used.add(scale)
        elif t.dtype in (torch.float8_e4m3fn, torch.int8):
            raise CheckpointError(f"{name} is stored as {t.dtype} without a scale tensor ({name}_scale_inv)")
        else:
            out[name] = t.to(dtype) if t.is_floating_point() else t
    return {k: v for k, v in out.items() if k not in used}
