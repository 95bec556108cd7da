"""Attention backends: one switch selects the implementation of the hot spots for a run."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..errors import ConfigError
from . import torch_ops


@dataclass(frozen=True)
class AttentionOps:
    """The three hot spots, same signatures in every backend (torch_ops.py; references in
    reference/)."""

    name: str
    pool_entries: Callable  # torch_ops.pool_entries
    indexer_scores: Callable  # torch_ops.indexer_gather_scores
    sparse_decode: Callable  # torch_ops.sparse_decode


TORCH_OPS = AttentionOps("torch", torch_ops.pool_entries, torch_ops.indexer_gather_scores, torch_ops.sparse_decode)


def get_backend(name: str) -> AttentionOps:
    if name == "torch":
        return TORCH_OPS
    if name == "triton":
        try:  # the kernels package loads its modules (and Triton) on first attribute access
            from .. import kernels

            return AttentionOps("triton", kernels.pool_entries, kernels.indexer_gather_scores, kernels.sparse_decode)
        except ImportError as exc:
            raise ConfigError(f"attention_backend='triton' needs triton installed: {exc}") from exc
    raise ConfigError(f"attention_backend={name!r} is not available; choose one of ('torch', 'triton')")
