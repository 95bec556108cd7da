"""The serving layout: paged pools (storage), per-row tables (a verify step's metadata) and
commit by slot moves. Storage knows slots and bytes; tables know trees and pages; kernels read
pools through tables and know nothing of requests."""
from .allocator import PageAllocator, PoolExhausted
from .commit import SlotMoves, apply_moves, plan_moves
from .kv_pool import KV_CACHE_DTYPES, POOL_KINDS, KVPool
from .pages import PageTable
from .pools import CompressorPools, CompressorShape, LayerPools, LayerShape, Layout, build_pools
from .records import IndexKeyLayout, RecordLayout, dequantize_rows, quantize_rows
from .swa_table import tree_swa_page_indices
from .tables import CompressTables, VerifyPlan, build_tables

__all__ = [
    "KV_CACHE_DTYPES", "POOL_KINDS", "CompressTables", "CompressorPools", "CompressorShape", "IndexKeyLayout",
    "KVPool", "LayerPools", "LayerShape", "Layout", "PageAllocator", "PageTable", "PoolExhausted", "RecordLayout",
    "SlotMoves", "VerifyPlan", "apply_moves", "build_pools", "build_tables", "dequantize_rows", "plan_moves",
    "quantize_rows", "tree_swa_page_indices",
]
