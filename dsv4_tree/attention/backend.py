"""Attention backends: one switch selects the implementation of the hot spots for a run."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..errors import ConfigError
from ..reference import ops as ref


@dataclass(frozen=True)
class AttentionOps:
    """The three hot spots, same signatures in every backend (see reference/ops.py)."""

    name: str
    pool_entries: Callable
    indexer_topk: Callable
    sparse_mqa_sink: Callable


TORCH_OPS = AttentionOps("torch", ref.ref_pool_entries, ref.ref_indexer_topk, ref.ref_sparse_mqa_sink)


def get_backend(name: str) -> AttentionOps:
    if name == "torch":
        return TORCH_OPS
    if name == "triton":
        try:  # the kernels package loads its modules (and Triton) on first attribute access
            from .. import kernels

            return AttentionOps("triton", kernels.pool_entries, kernels.indexer_topk, kernels.sparse_mqa_sink)
        except ImportError as exc:
            raise ConfigError(f"attention_backend='triton' needs triton installed: {exc}") from exc
    raise ConfigError(f"attention_backend={name!r} is not available; choose one of ('torch', 'triton')")
