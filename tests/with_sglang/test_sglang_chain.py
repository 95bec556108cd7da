"""A chain (EAGLE topk 1) through the plug-in's tree-verify builder equals SGLang 0.5.23's own
target-verify metadata (make_core_attn_metadata with init_compression_metadata, and the C4
indexer metadata) field for field."""
import torch
from sglang.srt.layers.attention import deepseek_v4_backend as dsv4

from dsv4_tree.sglang_plugin.metadata import tree_verify_metadata
from sgl_cases import CORE_FIELDS, INDEXER_FIELDS, StandIn, layout, same


def chain_links(bs: int, n: int):
    nxt = torch.arange(1, n + 1).masked_fill(torch.arange(n) == n - 1, -1).expand(bs, n).clone()
    return nxt, torch.full((bs, n), -1)


def sglang_linear(sb: StandIn, rpi, seq_lens, out_loc, n):
    """SGLang's make_forward_metadata_from_raw_verify for the static layout, up to its
    compressor plans (CUDA-compiled, not attention inputs)."""
    bs = len(seq_lens)
    slc, rep = sb.expand_extend_with_same_length(bs=bs, qo_len=n, seq_lens=seq_lens + n, req_pool_indices=rpi)
    core = sb.make_core_attn_metadata(req_to_token=sb.req_to_token, req_pool_indices_repeated=rep, seq_lens_casual=slc,
                                      max_seq_len=sb.MAX_SEQ_LEN_FOR_CAPTURE, out_loc=out_loc, need_compress=True,
                                      num_groups=bs)
    return core, sb.init_forward_metadata_indexer(core)


def test_chain_matches_sglang_field_for_field(no_flashmla_schedule):
    gen = torch.Generator().manual_seed(0)
    # contexts at and across C4 / C128 / page boundaries (the chain's rows close blocks there)
    cases = [(0, 3), (1, 4), (124, 127), (125, 250), (252, 253), (254, 511), (383, 640), (1019, 896)]
    for n in (1, 4, 6):
        for p0, p1 in cases:
            seq_lens = torch.tensor([p0, p1], dtype=torch.int32)
            req_to_token, mapping = layout([p0, p1], n, gen)
            rpi = torch.tensor([2, 1], dtype=torch.int32)
            out_loc = torch.cat([req_to_token[r, p:p + n] for r, p in zip(rpi.tolist(), [p0, p1])]).to(torch.int64)
            sb = StandIn(req_to_token, mapping, n)
            ref_core, ref_idx = sglang_linear(sb, rpi, seq_lens, out_loc, n)
            raw = dsv4.DSV4RawVerifyMetadata(req_pool_indices=rpi, seq_lens=seq_lens, out_cache_loc=out_loc,
                                             extend_seq_lens=torch.full((2,), n, dtype=torch.int32),
                                             total_verify_tokens=2 * n)
            ours = tree_verify_metadata(sb, raw, *chain_links(2, n))
            for f in CORE_FIELDS:
                a, b = getattr(ours.core_attn_metadata, f), getattr(ref_core, f)
                assert same(a, b), (n, p0, p1, f, a, b)
            for f in INDEXER_FIELDS:
                a, b = getattr(ours.indexer_metadata, f), getattr(ref_idx, f)
                assert same(a, b), (n, p0, p1, f, a, b)
            # the tree tables agree that every C4 / C128 entry of a chain is at its committed home
            assert torch.equal(ours.tree.c4_out_loc, ref_core.c4_out_loc)
            assert ours.c4_compress_metadata is None and ours.c128_compress_metadata is None
