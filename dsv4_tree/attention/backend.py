"""Attention backends: one switch selects the implementation of the hot spots for a run."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..errors import ConfigError
from ..reference import ops as ref
from ..reference import sparse_decode as ref_serving


@dataclass(frozen=True)
class AttentionOps:
    """The hot spots, same signatures in every backend (see reference/)."""

    name: str
    pool_entries: Callable  # ref_pool_entries
    indexer_scores: Callable  # ref_indexer_gather_scores (each row's branch keys)
    indexer_paged_scores: Callable  # ref_indexer_paged_scores (each request's committed keys)
    sparse_decode: Callable  # ref_sparse_decode


TORCH_OPS = AttentionOps("torch", ref.ref_pool_entries, ref_serving.ref_indexer_gather_scores,
                         ref_serving.ref_indexer_paged_scores, ref_serving.ref_sparse_decode)


def get_backend(name: str) -> AttentionOps:
    if name == "torch":
        return TORCH_OPS
    if name == "triton":
        try:  # the kernels package loads its modules (and Triton) on first attribute access
            from .. import kernels

            return AttentionOps("triton", kernels.pool_entries, kernels.indexer_gather_scores,
                                kernels.indexer_paged_scores, kernels.sparse_decode)
        except ImportError as exc:
            raise ConfigError(f"attention_backend='triton' needs triton installed: {exc}") from exc
    raise ConfigError(f"attention_backend={name!r} is not available; choose one of ('torch', 'triton')")
