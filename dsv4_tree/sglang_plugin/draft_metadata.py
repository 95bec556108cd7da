"""Draft-decode metadata for SGLang's DeepSeek-V4 multi-step draft backend with EAGLE topk > 1:
a normal `DSV4Metadata` with `bs x topk` SWA-only rows (`draft_tables.py`), so SGLang's
FlashMLA decode call runs unchanged on it.

The DeepSeek-V4 MTP layer has compress ratio 0 (`COMPRESS_RATIO_NEXTN_LAYER`), so its pool has
no compressed ratios and the metadata carries no compressor plan and no indexer, as SGLang's
own `make_forward_metadata_from_raw_decode` builds for that pool. The SWA write slot
(`swa_out_cache_loc`) is set afterwards by SGLang's `init_forward_metadata_in_graph` from the
step's slice of `out_cache_loc`, which already has one slot per row."""
from __future__ import annotations

import torch
from sglang.srt.layers.attention import deepseek_v4_backend as dsv4

from ..errors import ConfigError
from .draft_tables import build_draft_step_tables


def draft_step_metadata(backend, raw: dsv4.DSV4RawDecodeMetadata, out_cache_loc: torch.Tensor) -> dsv4.DSV4Metadata:
    """The full metadata of draft step `backend.speculative_step_id` from SGLang's raw decode
    record (bs requests) and the batch's multi-step `out_cache_loc` [bs * topk * num_steps]."""
    if backend.present_ratios:
        raise ConfigError(f"dsv4_tree draft decode (EAGLE topk={backend.topk}) builds SWA-only metadata; the draft "
                          f"pool has compressed ratios {backend.present_ratios} (the DeepSeek-V4 MTP layer has none)")
    tables = build_draft_step_tables(
        req_to_token=backend.req_to_token, full_to_swa_index_mapping=backend.token_to_kv_pool.full_to_swa_index_mapping,
        req_pool_indices=raw.req_pool_indices, seq_lens=raw.seq_lens, out_cache_loc=out_cache_loc,
        topk=backend.topk, num_steps=backend.speculative_num_steps, step=backend.speculative_step_id,
        swa_window=dsv4.SWA_WINDOW, page_size=backend.page_size, max_seq_len=backend.MAX_SEQ_LEN_FOR_CAPTURE,
        page_index_aligned_size=dsv4.PAGE_INDEX_ALIGNED_SIZE)
    core = dsv4.DSV4AttnMetadata(
        page_size=backend.page_size, raw_out_loc=tables.raw_out_loc, seq_lens_casual=tables.seq_lens_casual,
        cuda_int32_kwargs=backend.cuda_int32_kwargs, positions_casual=tables.positions_casual,
        page_table=tables.page_table, swa_page_indices=tables.swa_page_indices,
        swa_topk_lengths=tables.swa_topk_lengths, index_topk=backend.index_topk,
        present_ratios=backend.present_ratios, low_ratios=backend.low_ratios)
    core.init_compression_metadata()
    core.init_flashmla_related(is_prefill=False)
    return dsv4.DSV4Metadata(core, None)
