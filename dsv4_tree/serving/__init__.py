"""The serving layout: paged pools (storage), per-row tables (a verify step's metadata) and
commit by slot moves. Storage knows slots and bytes; tables know trees and pages; kernels read
pools through tables and know nothing of requests."""
from .allocator import PageAllocator, PoolExhausted
from .commit import SlotMoves, apply_moves, plan_moves
from .kv_pool import KVPool
from .pages import PageTable
from .pools import CompressorPools, LayerPools, Layout, build_pools
from .tables import CompressTables, VerifyPlan, build_tables

__all__ = [
    "CompressTables", "CompressorPools", "KVPool", "LayerPools", "Layout", "PageAllocator", "PageTable",
    "PoolExhausted", "SlotMoves", "VerifyPlan", "apply_moves", "build_pools", "build_tables", "plan_moves",
]
