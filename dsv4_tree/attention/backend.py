"""Attention backends: one switch selects the implementation of the hot spots for a run."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..errors import ConfigError
from ..numerics import hc
from . import compress, rows, torch_ops


@dataclass(frozen=True)
class AttentionOps:
    """The hot spots, same signatures in every backend (torch_ops.py; references in reference/)."""

    name: str
    pool_entries: Callable  # torch_ops.pool_entries
    indexer_scores: Callable  # torch_ops.indexer_gather_scores (each row's branch keys)
    indexer_paged_scores: Callable  # torch_ops.indexer_paged_scores (each request's committed keys)
    sparse_decode: Callable  # torch_ops.sparse_decode
    indexer_topk: Callable  # torch_ops.indexer_topk (scores of both kinds + the tie rule's top-k as slots)
    hc_pre: Callable = hc.hc_pre  # an mHC block's pre side + the block's input norm (numerics/hc.py)
    hc_post: Callable = hc.hc_merge  # an mHC block's post side: the merge into the streams
    q_rows: Callable = rows.q_rows  # the query: projections, q_a_norm, q_b_norm + RoPE (attention/rows.py)
    swa_write: Callable = rows.swa_write  # the SWA K=V rows: kv_proj, kv_norm, RoPE, the pool's store
    rope_rows: Callable = rows.rope_rows  # RoPE of [1, H, T, d] rows (the indexer query; inverse: the output)
    compressor_write: Callable = compress.write_compressor  # a compressor's rows, then its entries (compress.py)
    # the Triton kernels package, for what serving runs as kernels under this backend (the table
    # build, FP8 K=V stores, commit moves: ServingRuntime(kernels=...)); None: their torch paths
    kernels: object = None


TORCH_OPS = AttentionOps("torch", torch_ops.pool_entries, torch_ops.indexer_gather_scores,
                         torch_ops.indexer_paged_scores, torch_ops.sparse_decode, torch_ops.indexer_topk)


def get_backend(name: str) -> AttentionOps:
    if name == "torch":
        return TORCH_OPS
    if name == "triton":
        try:  # the kernels package loads its modules (and Triton) on first attribute access
            from .. import kernels

            return AttentionOps("triton", kernels.pool_entries, kernels.indexer_gather_scores,
                                kernels.indexer_paged_scores, kernels.sparse_decode, kernels.indexer_topk,
                                hc_pre=kernels.hc_pre, hc_post=kernels.hc_post, q_rows=rows.triton_q_rows,
                                swa_write=rows.triton_swa_write, rope_rows=rows.triton_rope_rows,
                                compressor_write=kernels.compressor_write, kernels=kernels)
        except ImportError as exc:
            raise ConfigError(f"attention_backend='triton' needs triton installed: {exc}") from exc
    raise ConfigError(f"attention_backend={name!r} is not available; choose one of ('torch', 'triton')")
