"""Tree verify's C4 indexer in SGLang 0.5.23: every row scores and selects over its own path's
C4 entries (`branch_candidates.py`), with SGLang's own pieces in SGLang's order.

Per layer (`forward_c4_indexer` of the tree backend on tree metadata):

1. q and weights through SGLang's `_forward_prepare_normal` / `_forward_prepare_multi_stream`
   (which also run the indexer compressor: the tree backend's branch compressor).
2. SGLang's logits function (DeepGEMM's `fp8_paged_mqa_logits`, or its torch reference under
   `SGLANG_FP8_PAGED_MQA_LOGITS_TORCH`) over the rows' page table, exactly SGLang's call, and a
   second call of the same function over each row's scratch pages (`scratch_index_pages`, a
   `PagedIndexerMetadata` built once per verify, `TreeDSV4Metadata.branch_indexer`, scores
   [T, 128]): the score of a scratch key comes from the same arithmetic as a key the page table
   names.
3. The scratch blocks' columns spliced in (`splice_branch_scores`), then SGLang's top-k transform
   (the backend's `dsa_topk_backend`, as SGLang dispatches it) writing
   `c4_sparse_page_indices` and the block positions, then the selected branch blocks remapped to
   their own entries' slots (`remap_branch_indices`), which the sparse attention reads.

A row none of whose branch entries is in scratch (every chain) gets SGLang's logits unchanged, so
SGLang's top-k result; the remap then rewrites home slots with themselves. No host reads; the
FP4 indexer, HiSparse and the TileLang / AITER / XPU logits kernels are refused by name."""
from __future__ import annotations

import torch
from sglang.srt.environ import envs
from sglang.srt.layers.attention.dsv4 import indexer as sgl_indexer
from sglang.srt.runtime_context import get_platform

from ..errors import ConfigError, StateError
from .branch_candidates import SCRATCH_INDEX_PAGES, remap_branch_indices, splice_branch_scores

INDEX_K_BYTES = 132  # 128 fp8 values + one fp32 scale per key (SGLang's FP8 indexer page layout)
INDEX_PAGE = 64


def logits_fn():
    """SGLang's FP8 paged logits function for this process -> (fn, lens_2d): lens_2d when SGLang
    hands it [rows, 1] lengths (DeepGEMM) rather than [rows]."""
    if envs.SGLANG_OPT_USE_TILELANG_INDEXER.get() or envs.SGLANG_OPT_USE_AITER_INDEXER.get():
        raise ConfigError("dsv4_tree tree indexer: SGLANG_OPT_USE_TILELANG_INDEXER / SGLANG_OPT_USE_AITER_INDEXER "
                          "are not supported (DeepGEMM or SGLANG_FP8_PAGED_MQA_LOGITS_TORCH)")
    if envs.SGLANG_FP8_PAGED_MQA_LOGITS_TORCH.get():
        if get_platform().is_sm120:
            return sgl_indexer.fp8_paged_mqa_logits_torch_sm120, False
        return sgl_indexer.fp8_paged_mqa_logits_torch, False
    if sgl_indexer.is_xpu():
        raise ConfigError("dsv4_tree tree indexer: XPU logits kernels are not supported")
    from deep_gemm import fp8_paged_mqa_logits

    return fp8_paged_mqa_logits, True


def _topk_transform(backend, idx_meta, rows: slice, all_rows: bool, logits, out_pages, out_raw, plan) -> None:
    """SGLang's top-k transform of logits for `rows`, dispatched on the backend's top-k backend
    as SGLang's `forward_c4_indexer` dispatches it."""
    args = (logits, idx_meta.compressed_seq_lens[rows], idx_meta.page_table[rows], out_pages,
            idx_meta.compressed_page_size)
    topk = backend.dsa_topk_backend
    if topk.is_torch():
        sgl_indexer.topk_transform_pytorch_vectorized(*args, out_raw)
    elif topk.is_flashinfer():
        backend.flashinfer_topk_transform(*args, out_raw)
    elif topk.should_use_topk_v2():
        if plan is None:
            plan = idx_meta.topk_metadata if all_rows else sgl_indexer.plan_topk_v2(idx_meta.compressed_seq_lens[rows])
        sgl_indexer.topk_transform_paged_v2(*args, plan, out_raw)
    else:
        sgl_indexer.topk_transform_paged(*args, out_raw)


def tree_c4_indexer(backend, meta, x, q_lora, c4_indexer, forward_batch, alt_streams=None,
                    enable_multi_stream: bool = False, q_lora_ready=None, skip_compressor: bool = False,
                    q_lora_quant=None) -> None:
    """The C4 indexer of one layer for a tree verify (module note). meta: TreeDSV4Metadata."""
    if c4_indexer.use_fp4_indexer:
        raise ConfigError("dsv4_tree tree indexer: the FP4 indexer (enable_deepseek_v4_fp4_indexer) is not supported")
    if getattr(backend, "hisparse_coordinator", None) is not None:
        raise ConfigError("dsv4_tree tree indexer: HiSparse (hisparse_coordinator) is not supported")
    core, idx, tree, branch = meta.core_attn_metadata, meta.indexer_metadata, meta.tree, meta.branch_indexer
    positions = core.positions
    rows_total = positions.shape[0]
    if x.shape[0] != rows_total or q_lora.shape[0] != rows_total:
        raise StateError(f"dsv4_tree tree indexer: {rows_total} verify rows, got x with {x.shape[0]} and q_lora "
                         f"with {q_lora.shape[0]} rows (the verify metadata covers the batch as the forward runs it, "
                         f"DP padding included)")
    if enable_multi_stream:
        q_indexer, weights = backend._forward_prepare_multi_stream(
            x=x, q_lora=q_lora, c4_indexer=c4_indexer, positions=positions, forward_batch=forward_batch,
            alt_streams=alt_streams, q_lora_ready=q_lora_ready)
    else:
        q_indexer, weights = backend._forward_prepare_normal(
            x=x, q_lora=q_lora, c4_indexer=c4_indexer, positions=positions, forward_batch=forward_batch,
            skip_compressor=skip_compressor, q_lora_quant=q_lora_quant)
    q = q_indexer.unsqueeze(1)
    weights = weights.squeeze(2)
    fn, lens_2d = logits_fn()
    pool = backend.token_to_kv_pool
    cache = pool.get_index_k_with_scale_buffer(layer_id=c4_indexer.layer_id)
    cache = cache.view(cache.shape[0], INDEX_PAGE, 1, INDEX_K_BYTES)

    def lens_of(m, rows):
        lens = m.compressed_seq_lens[rows]
        return lens.unsqueeze(-1) if lens_2d else lens

    scratch_cols = SCRATCH_INDEX_PAGES * INDEX_PAGE
    scratch_logits = torch.cat([fn(q[rows], cache, weights[rows], lens_of(branch, rows), branch.page_table[rows],
                                   dg, scratch_cols, False)
                                for rows, dg in branch.row_chunks()])
    out_pages = core.c4_sparse_page_indices
    raw = core.c4_sparse_raw_indices if core.c4_sparse_raw_indices is not None else torch.empty_like(out_pages)
    chunks = idx.row_chunks()
    plans = idx.topk_metadata_chunks
    start = pool.dsv4_tree_scratch.start[4]
    for k, (rows, dg) in enumerate(chunks):
        logits = fn(q[rows], cache, weights[rows], lens_of(idx, rows), idx.page_table[rows], dg,
                    idx.max_compressed_seq_len, False)
        splice_branch_scores(logits, scratch_logits[rows], tree.c4_branch[rows], tree.c4_committed[rows],
                             branch.page_table[rows], start, INDEX_PAGE)
        _topk_transform(backend, idx, rows, len(chunks) == 1, logits, out_pages[rows], raw[rows],
                        plans[k] if plans is not None else None)
    out_pages.copy_(remap_branch_indices(out_pages, raw, tree.c4_branch, tree.c4_committed))
    capturer = sgl_indexer.get_global_indexer_capturer()
    if capturer is not None:
        capturer.capture(pool.layer_mapping[c4_indexer.layer_id].compress_layer_id, raw)
