"""Serving layout: paged storage (records, pools) and the per-row index tables of a verify step."""
from .kv_pool import KV_DTYPES, POOL_KINDS, KVPool
from .records import IndexKeyLayout, RecordLayout, dequantize_rows, quantize_rows
from .swa_table import tree_swa_page_indices

__all__ = [
    "KV_DTYPES", "POOL_KINDS", "IndexKeyLayout", "KVPool", "RecordLayout", "dequantize_rows", "quantize_rows",
    "tree_swa_page_indices",
]
