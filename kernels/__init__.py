"""Triton kernels of dsv4-tree, installed as `dsv4_tree.kernels` (never as a top-level
`kernels` package: Hugging Face's `kernels` package owns that import name).

Each kernel is paired with a torch reference in `dsv4_tree/reference/ops.py`:
  sparse_mqa_sink  <-> ref_sparse_mqa_sink   (kernels/sparse_attention.py)
  indexer_topk     <-> ref_indexer_topk      (kernels/indexer.py; scores in Triton, shared tie rule)
  pool_entries     <-> ref_pool_entries      (kernels/compressor.py)
  sparse_decode          <-> ref_sparse_decode          (kernels/sparse_decode.py; reference in reference/sparse_decode.py)
  indexer_gather_scores  <-> ref_indexer_gather_scores  (kernels/indexer_gather.py; reference in reference/sparse_decode.py)
On CPU they run under TRITON_INTERPRET=1 (set before triton is imported)."""
from .compressor import pool_entries
from .indexer import indexer_scores, indexer_topk
from .indexer_gather import indexer_gather_scores
from .sparse_attention import sparse_mqa_sink
from .sparse_decode import sparse_decode

__all__ = ["indexer_gather_scores", "indexer_scores", "indexer_topk", "pool_entries", "sparse_decode",
           "sparse_mqa_sink"]
