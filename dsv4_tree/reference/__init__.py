"""Torch references: the hot-spot ops and the per-path Hugging Face oracle."""
from .ops import indexer_scores, ref_indexer_topk, ref_pool_entries, ref_sparse_mqa_sink
from .per_path import per_path_logits, relative_error

__all__ = [
    "indexer_scores", "per_path_logits", "ref_indexer_topk", "ref_pool_entries", "ref_sparse_mqa_sink",
    "relative_error",
]
