"""Torch references: the hot-spot ops and the per-path Hugging Face oracle."""
from .ops import TIE_MARGIN, ref_pool_entries, ref_select_topk, ref_sparse_mqa_sink
from .per_path import per_path_logits, relative_error
from .sparse_decode import ref_indexer_gather_scores, ref_sparse_decode

__all__ = [
    "TIE_MARGIN", "per_path_logits", "ref_indexer_gather_scores", "ref_pool_entries", "ref_select_topk",
    "ref_sparse_decode", "ref_sparse_mqa_sink", "relative_error",
]
