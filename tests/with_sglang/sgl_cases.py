"""Shared builders for the SGLang tests: page-aligned request layouts in SGLang's form, EAGLE
trees from SGLang's own draft pipeline, and a stand-in backend that runs SGLang's own metadata
methods (no ModelRunner, no GPU)."""
from __future__ import annotations

import torch
from sglang.kernels.ops.speculative.spec_tree import TreeMaskMode, sgl_build_tree_kernel_triton
from sglang.srt.layers.attention import deepseek_v4_backend as dsv4
from sglang.srt.speculative.eagle_utils import organize_draft_results
from sglang.srt.speculative.spec_utils import select_top_k_tokens

from dsv4_tree.sglang_plugin.scratch import TreeScratch

PAGE = 256
I32 = {"device": "cpu", "dtype": torch.int32}


def layout(seq_lens: list[int], n: int, gen: torch.Generator, extra_rows: int = 0, max_len: int = 2048):
    """req_to_token [rows, max_len] int32 (request b at row b + 1, page-aligned pages drawn at
    random, none of them page 0) and full_to_swa_index_mapping (page-wise random, trailing -1
    sentinel as SGLang's pool keeps it). Rows past len(seq_lens) + 1 are free for chains."""
    rows = len(seq_lens) + 1 + extra_rows
    pages_per_row = max_len // PAGE
    num_pages = 1 + rows * pages_per_row
    perm = torch.randperm(num_pages - 1, generator=gen) + 1
    req_to_token = torch.zeros(rows, max_len, dtype=torch.int32)
    pos = torch.arange(max_len)
    for r in range(rows):
        pages = perm[r * pages_per_row:(r + 1) * pages_per_row]
        req_to_token[r] = (pages[pos // PAGE] * PAGE + pos % PAGE).to(torch.int32)
    swa_pages = torch.randperm(num_pages, generator=gen)
    full = torch.arange(num_pages * PAGE)
    mapping = torch.cat([swa_pages[full // PAGE] * PAGE + full % PAGE, torch.tensor([-1])]).to(torch.int64)
    return req_to_token, mapping


def sglang_draft_lists(bs: int, topk: int, steps: int, gen: torch.Generator):
    """SGLang's draft step outputs: select_top_k_tokens per step on random draft probabilities.
    -> (score_list, token_list, parents_list), organize_draft_results' inputs."""
    hidden = torch.zeros(bs, 4)
    scores = None
    s_list, t_list, p_list = [], [], []
    rows = bs
    for i in range(steps):
        p = torch.rand(rows, topk, generator=gen).softmax(-1)
        p, order = p.sort(dim=-1, descending=True)
        tok = torch.randint(0, 1000, (rows, topk), generator=gen)
        _, hidden, scores, info = select_top_k_tokens(i, p, tok, hidden, scores, topk)
        s_list.append(info[0]), t_list.append(info[1]), p_list.append(info[2])
        rows = bs * topk
        hidden = torch.zeros(rows, 4)
    return s_list, t_list, p_list


def sglang_tree(bs: int, topk: int, steps: int, n: int, seq_lens: torch.Tensor, gen: torch.Generator):
    """An EAGLE tree as SGLang builds it: `sglang_draft_lists`, organize_draft_results,
    sgl_build_tree_kernel_triton (QLEN_ONLY).
    -> (positions [bs*N], retrieve_next_token [bs, N], retrieve_next_sibling [bs, N])."""
    parent_list, top_idx, _ = organize_draft_results(*sglang_draft_lists(bs, topk, steps, gen), n)
    tree_mask = torch.ones(bs * n * n, dtype=torch.bool)  # QLEN_ONLY: one [N, N] block per request
    positions = torch.empty(bs * n, dtype=torch.long)
    ri, rn, rs = torch.full((3, bs, n), -1, dtype=torch.long)
    sgl_build_tree_kernel_triton(parent_list, top_idx, seq_lens.to(torch.long), tree_mask, positions, ri, rn, rs,
                                 topk, steps, n, TreeMaskMode.QLEN_ONLY)
    return positions, rn, rs


class StandIn:
    """What SGLang's DeepseekV4AttnBackend metadata methods read of `self`, for the plain
    paged-SWA DeepSeek-V4 pool (ratios 4 and 128, index_topk 512); the methods are SGLang's."""
    make_core_attn_metadata = dsv4.DeepseekV4AttnBackend.make_core_attn_metadata
    init_forward_metadata_indexer = dsv4.DeepseekV4AttnBackend.init_forward_metadata_indexer
    expand_extend_with_same_length = dsv4.DeepseekV4AttnBackend.expand_extend_with_same_length

    class _TopkBackend:
        @staticmethod
        def should_use_topk_v2() -> bool:
            return False  # plan_topk_v2 is CUDA-only; SGLang's choice on a GPU does not change any row's lengths

    def __init__(self, req_to_token: torch.Tensor, mapping: torch.Tensor, num_draft_tokens: int):
        self.req_to_token = req_to_token
        self.cuda_int32_kwargs = I32
        self.page_size = PAGE
        self.present_ratios, self.low_ratios = (4, 128), ()
        self.has_c4 = self.has_c128 = True
        self.index_topk = 512
        self.trtllm_attn = self.is_dspark_draft = self.encoder_replay = False
        self.encoder_row_floor = None
        self.enable_deepseek_v4_fp4_indexer = False
        self.dsa_topk_backend = self._TopkBackend()
        self.MAX_SEQ_LEN_FOR_CAPTURE = req_to_token.shape[1]
        self.speculative_num_draft_tokens = num_draft_tokens
        self.token_to_kv_pool = type("Pool", (), {})()
        pool = self.token_to_kv_pool
        pool.request_window = pool.swa_req_ring_size = pool.unified_kv_pool = None
        pool.full_to_swa_index_mapping = mapping
        pool.c128_size = req_to_token.numel() // 128 + 8
        pool.c4_logical_size = pool.c128_size * 32
        # scratch past every committed entry slot these layouts address (their slots stay below numel)
        pool.dsv4_tree_scratch = TreeScratch({4: pool.c4_logical_size, 128: pool.c128_size}, num_draft_tokens,
                                             req_to_token.shape[0])


CORE_FIELDS = ("page_table", "raw_out_loc", "seq_lens_casual", "positions_casual", "swa_page_indices",
               "swa_topk_lengths", "c4_out_loc", "c4_topk_lengths_raw", "c4_topk_lengths_clamp1",
               "c4_sparse_topk_lengths", "c4_sparse_page_indices", "c128_out_loc", "c128_page_indices",
               "c128_topk_lengths_clamp1", "present_ratios", "low_ratios", "index_topk", "page_size")
INDEXER_FIELDS = ("page_size", "compressed_page_size", "page_table", "compressed_seq_lens", "use_topk_v2",
                  "compress_ratio", "rows_per_request")


def path_as_chain(req_to_token, rid: int, P: int, path: list, chain_row: int) -> torch.Tensor:
    """req_to_token with row `chain_row` holding request `rid`'s committed P slots, then the
    slots of `path` (node indices, root first) in order: the path laid out as SGLang's chain."""
    chain = req_to_token.clone()
    chain[chain_row, :P] = req_to_token[rid, :P]
    chain[chain_row, P:P + len(path)] = req_to_token[rid, [P + a for a in path]]
    return chain


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a == b
