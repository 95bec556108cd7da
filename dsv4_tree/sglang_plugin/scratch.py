"""Scratch entry slots for tree verify in SGLang's C4 / C128 entry pools, and the per-layer views
of a `DeepSeekV4TokenToKVPool` the write side uses.

Siblings that close a block write their compressed entry (and C4 indexer key) to a scratch slot
`start[m] + req_pool_index * per_request + node` (`tables.tree_entry_out_loc`). The scratch
pages are appended to each layer's buffer of SGLang's C4 KV pool, C4 indexer pool and C128 KV
pool, past every page SGLang allocated (SGLang's paged allocator reserves one logical page, so
its own slots reach `size + 256 / m - 1`; the scratch starts after the last existing page, at one
start shared by the C4 KV and indexer pools, which both take `c4_out_loc`). SGLang never
addresses these pages: its page tables name committed slots only. Growing is done once per pool
object, before any forward, and is recorded on the pool (`pool.dsv4_tree_scratch`)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ConfigError
from .pool_bytes import (INDEX_K_DATA_BYTES, INDEX_K_SCALE_BYTES, V4_DATA_BYTES, V4_SCALE_BYTES, PagedRecords,
                         StateRows)

RATIOS = (4, 128)


@dataclass(frozen=True)
class TreeScratch:
    """Scratch entry slots of one pool: slots start[m] .. start[m] + slots_per_ratio - 1."""
    start: dict  # ratio -> first scratch slot
    per_request: int  # scratch slots per request pool index (the verify window, N)
    num_req_slots: int

    @property
    def slots(self) -> int:
        return self.per_request * self.num_req_slots

    def trash(self, ratio: int) -> int:
        """One entry slot past the scratch slots: the compressor's fixed-shape call writes the
        entries of rows that close no block here (nothing reads it)."""
        return self.start[ratio] + self.slots


def _entry_buffers(pool, ratio: int) -> list:
    """(owner object, attribute, page_size) of every buffer list addressed by c{ratio}_out_loc."""
    out = []
    kv = getattr(pool, "kv_pools", {}).get(ratio)
    if kv is not None:
        out.append((kv, "kv_buffer", kv.page_size))
    idx = getattr(pool, "index_pools", {}).get(ratio)
    if idx is not None:
        if getattr(idx, "index_k_with_scale_buffer", None) is None:
            raise ConfigError("dsv4_tree tree verify: the FP4 (split) indexer layout is not supported")
        out.append((idx, "index_k_with_scale_buffer", idx.page_size))
    return out


def check_no_cached_addresses(pool) -> None:
    """Refuse (before growing) a pool whose entry buffers' addresses were cached: growing replaces
    the buffer tensors, so a cached address would name the old memory. SGLang's HiSparse C4 pool
    (`HiSparseC4DevicePool`) caches them in `data_ptrs` at construction."""
    for m in RATIOS:
        for owner, attr, _ in _entry_buffers(pool, m):
            if getattr(owner, "data_ptrs", None) is not None or type(owner).__name__ == "HiSparseC4DevicePool":
                raise ConfigError(f"dsv4_tree tree verify: the ratio-{m} pool {type(owner).__name__} caches its "
                                  f"buffers' addresses (data_ptrs; HiSparse, --enable-hisparse), which the tree "
                                  f"backend's scratch pages would replace: not supported")


def ensure_scratch(pool, per_request: int) -> TreeScratch:
    """Grow the pool's C4 / C128 entry buffers by the scratch slots (once); returns its TreeScratch."""
    have = getattr(pool, "dsv4_tree_scratch", None)
    if have is not None:
        if have.per_request < per_request:
            raise ConfigError(f"dsv4_tree: the pool's scratch holds {have.per_request} slots per request, "
                              f"a verify needs {per_request} (speculative_num_draft_tokens)")
        return have
    check_no_cached_addresses(pool)
    num_req_slots = int(pool.num_req_slots)
    start = {}
    for m in RATIOS:
        bufs = _entry_buffers(pool, m)
        if not bufs:
            start[m] = 0
            continue
        start[m] = max(getattr(o, a)[0].shape[0] * ps for o, a, ps in bufs)
        for owner, attr, ps in bufs:
            if start[m] % ps:
                raise ConfigError(f"dsv4_tree: ratio-{m} pools with page sizes that do not divide {start[m]}")
            need = -(-(start[m] + per_request * num_req_slots + 1) // ps)  # + the trash slot
            grown = []
            for buf in getattr(owner, attr):
                extra = need - buf.shape[0]
                grown.append(torch.cat([buf, buf.new_zeros(extra, buf.shape[1])]) if extra > 0 else buf)
            setattr(owner, attr, grown)
    scratch = TreeScratch(start, per_request, num_req_slots)
    pool.dsv4_tree_scratch = scratch
    return scratch


@dataclass(frozen=True)
class LayerBuffers:
    """One model layer's buffers in a DeepSeek-V4 pool (None where the layer has none)."""
    ratio: int  # 0, 4 or 128
    swa: PagedRecords
    entries: PagedRecords | None  # C4 / C128 compressed K=V entries
    index_keys: PagedRecords | None  # C4 indexer keys
    state: object | None  # the attention compressor's CompressStatePool
    index_state: object | None  # the indexer compressor's CompressStatePool

    def state_rows(self) -> list:
        return [StateRows(p.kv_score_buffer.kv_score) for p in (self.state, self.index_state) if p is not None]


def layer_buffers(pool, layer_id: int) -> LayerBuffers:
    swa_pool = pool.swa_kv_pool
    swa = PagedRecords(swa_pool.kv_buffer[pool._swa_local_layer_id(layer_id)], swa_pool.page_size,
                       V4_DATA_BYTES, V4_SCALE_BYTES)
    item = pool.layer_mapping[layer_id]
    ratio = int(item.compress_ratio) if item is not None else 0
    entries = index_keys = state = index_state = None
    if ratio in RATIOS:
        kv = pool.kv_pools[ratio]
        entries = PagedRecords(kv.kv_buffer[item.compress_layer_id], kv.page_size, V4_DATA_BYTES, V4_SCALE_BYTES)
        idx = pool.index_pools.get(ratio)
        if idx is not None:
            index_keys = PagedRecords(idx.index_k_with_scale_buffer[item.compress_layer_id], idx.page_size,
                                      INDEX_K_DATA_BYTES, INDEX_K_SCALE_BYTES)
        state = pool.compress_state_pools[layer_id]
        index_state = pool.indexer_compress_state_pools[layer_id]
    elif ratio != 0:
        raise ConfigError(f"dsv4_tree tree verify: layer {layer_id} has compress ratio {ratio} (only 0, 4, 128)")
    return LayerBuffers(ratio, swa, entries, index_keys, state, index_state)


def pool_layers(pool) -> list:
    return [layer_buffers(pool, i) for i in range(pool._stage_start, pool._stage_end)]
