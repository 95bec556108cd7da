"""Tree-verify metadata for SGLang's DeepSeek-V4 backend: a normal `DSV4Metadata` whose rows are
tree rows (`tables.py`), so SGLang's FlashMLA sparse-decode call runs unchanged on it.

`tree_core_attn_metadata` follows SGLang 0.5.23's `make_core_attn_metadata` for the plain
paged-SWA case (no request window, ring, DSpark or low-ratio layers: `validate.py` refuses
them), with the lengths taken from each node's depth and the three tree-specific fields
(SWA index lists, entry write slots, C128 branch entries) from `tables.py`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from sglang.kernels.ops.attention.dsv4.attn_metadata_kernels import BuildPageTablePositions
from sglang.srt.layers.attention import deepseek_v4_backend as dsv4
from sglang.srt.layers.attention.dsv4.metadata import PagedIndexerMetadata

from ..errors import StateError
from .branch_candidates import scratch_index_pages
from .commit import check_no_pending_commit
from .scratch import TreeScratch
from .tables import TreeVerifyTables, build_tree_verify_tables, tree_c128_page_indices


@dataclass
class TreeDSV4Metadata(dsv4.DSV4Metadata):
    """SGLang's DSV4Metadata plus the tree tables its write side (compressor, commit) and the
    tree indexer read; branch_indexer: the indexer metadata of each row's scratch pages
    (`indexer.py`), None without C4 layers."""
    tree: Optional[TreeVerifyTables] = None
    branch_indexer: Optional[PagedIndexerMetadata] = None


def tree_scratch(pool, window: int) -> TreeScratch:
    """The pool's scratch entry slots (`scratch.ensure_scratch`, run when the tree backend is
    built), checked to hold a verify window of `window` nodes per request."""
    scratch = getattr(pool, "dsv4_tree_scratch", None)
    if scratch is None:
        raise StateError("dsv4_tree tree verify: the KV pool has no scratch entry slots "
                         "(the tree backend grows it at construction)")
    if window > scratch.per_request:
        raise StateError(f"dsv4_tree tree verify: a window of {window} nodes per request, the pool's scratch "
                         f"holds {scratch.per_request}")
    return scratch


def tree_core_attn_metadata(backend, tables: TreeVerifyTables, out_cache_loc: torch.Tensor,
                            max_seq_len: int) -> dsv4.DSV4AttnMetadata:
    prep = BuildPageTablePositions.execute(
        req_to_token=backend.req_to_token, req_pool_indices_repeated=tables.req_pool_indices_repeated,
        seq_lens_casual=tables.seq_lens_casual, max_seq_len=max_seq_len, page_size=backend.page_size,
        swa_window=dsv4.SWA_WINDOW)
    core = dsv4.DSV4AttnMetadata(
        page_size=backend.page_size, raw_out_loc=out_cache_loc, seq_lens_casual=prep.seq_lens_casual,
        cuda_int32_kwargs=backend.cuda_int32_kwargs, positions_casual=prep.positions_casual,
        page_table=prep.page_table, swa_page_indices=tables.swa_page_indices,
        swa_topk_lengths=prep.swa_topk_lengths, index_topk=backend.index_topk,
        present_ratios=backend.present_ratios, low_ratios=backend.low_ratios)
    core.init_compression_metadata()
    if core.has_c4:
        core.c4_out_loc = tables.c4_out_loc
    if core.has_c128:
        core.c128_out_loc = tables.c128_out_loc
        core.c128_page_indices = tree_c128_page_indices(core.c128_page_indices, tables.c128_branch,
                                                        core.seq_lens_casual, tables.c128_committed)
    core.init_flashmla_related(is_prefill=False)
    return core


def tree_verify_metadata(backend, raw: dsv4.DSV4RawVerifyMetadata, retrieve_next_token: torch.Tensor,
                         retrieve_next_sibling: torch.Tensor) -> TreeDSV4Metadata:
    """The full metadata of one tree verify from SGLang's raw verify record (the batch as the
    forward runs it: under DP attention, padded to the DP width) and the tree (the real requests'
    rows; the padding requests get chain rows, `tables.pad_links_as_chains`)."""
    pool = backend.token_to_kv_pool
    check_no_pending_commit(pool, "a tree verify")
    n = int(retrieve_next_token.shape[1])
    bs = raw.req_pool_indices.shape[0]
    if raw.out_cache_loc.shape != (bs * n,):
        raise StateError(f"dsv4_tree tree verify: out_cache_loc {tuple(raw.out_cache_loc.shape)} must hold "
                         f"bs * N = {bs} * {n} = {bs * n} slots (req_pool_indices, DP padding included; "
                         f"N = spec_info.retrieve_next_token's width)")
    scratch = tree_scratch(pool, n)
    tables = build_tree_verify_tables(
        req_to_token=backend.req_to_token, full_to_swa_index_mapping=pool.full_to_swa_index_mapping,
        req_pool_indices=raw.req_pool_indices, seq_lens=raw.seq_lens, retrieve_next_token=retrieve_next_token,
        retrieve_next_sibling=retrieve_next_sibling, swa_window=dsv4.SWA_WINDOW,
        scratch_start=scratch.start, scratch_per_request=scratch.per_request,
        page_index_aligned_size=dsv4.PAGE_INDEX_ALIGNED_SIZE)
    core = tree_core_attn_metadata(backend, tables, raw.out_cache_loc, backend.MAX_SEQ_LEN_FOR_CAPTURE)
    indexer = backend.init_forward_metadata_indexer(core) if backend.has_c4 else None
    # Compressor plans (c4 / c128_compress_metadata) are per-branch writes: SGLang's
    # position-addressed plans collide for siblings, so none is attached here.
    return TreeDSV4Metadata(core, indexer, tree=tables,
                            branch_indexer=branch_indexer_metadata(backend, tables, scratch, indexer))


def branch_indexer_metadata(backend, tables: TreeVerifyTables, scratch: TreeScratch,
                            indexer: Optional[PagedIndexerMetadata]) -> Optional[PagedIndexerMetadata]:
    """SGLang's PagedIndexerMetadata (its DeepGEMM schedule included) for scoring every row's query
    against its request's scratch pages (`branch_candidates.scratch_index_pages`), page-table
    width as SGLang's indexer's."""
    if indexer is None:
        return None
    page = indexer.compressed_page_size
    table, lens = scratch_index_pages(tables.req_pool_indices_repeated, scratch.start[4], scratch.per_request,
                                      scratch.start[4] + scratch.slots - 1, page, indexer.page_table.shape[1])
    return PagedIndexerMetadata(page_size=indexer.page_size, compressed_page_size=page, page_table=table,
                                compressed_seq_lens=lens, use_topk_v2=False,
                                force_deep_gemm_metadata=indexer.force_deep_gemm_metadata)
