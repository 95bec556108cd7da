"""Torch references: the hot-spot ops and the per-path Hugging Face oracle."""
from .ops import gather_rows, indexer_scores, ref_indexer_topk, ref_pool_entries, ref_sparse_mqa_sink, select_topk
from .per_path import per_path_logits, relative_error

__all__ = [
    "gather_rows", "indexer_scores", "per_path_logits", "ref_indexer_topk", "ref_pool_entries", "ref_sparse_mqa_sink",
    "relative_error", "select_topk",
]
