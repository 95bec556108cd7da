"""Numerically: our reference sparse decode over pools in SGLang 0.5.23's byte layout (the V4
record split per page as `kv_layout.py` addresses it) reads, for every tree row with the
plug-in's tree metadata, exactly what the same decode reads with that row's path laid out as a
chain and SGLang's own linear metadata."""
import torch
from sglang.kernels.ops.attention.dsv4.kv_layout import KVLayout
from sglang.srt.layers.attention import deepseek_v4_backend as dsv4

from dsv4_tree.reference import ref_sparse_decode
from dsv4_tree.serving import KVPool
from dsv4_tree.sglang_plugin.metadata import tree_verify_metadata
from sgl_cases import PAGE, StandIn, layout, path_as_chain, sglang_tree
from test_sglang_tree_rows import paths

D, ROPE, H = 512, 64, 4


def fp8_pool(num_slots: int, page_size: int, gen=None) -> KVPool:
    pool = KVPool(num_slots, D, ROPE, "fp8_e4m3", page_size, "cpu", torch.float32)
    if gen is not None:
        pool.write(torch.arange(num_slots), torch.randn(num_slots, D, generator=gen))
    return pool


def test_pool_bytes_are_sglang_v4_layout():
    gen = torch.Generator().manual_seed(1)
    pool = fp8_pool(2 * PAGE, PAGE, gen)
    v4 = KVLayout.V4
    assert pool.bytes_per_token == v4.bytes_per_token == 584
    data_stride, scale_base, scale_stride = v4.row_addressing(PAGE)
    slots = torch.tensor([0, 1, 77, 255, 256, 300, 511])
    records = pool.record_bytes(slots)
    for s, rec in zip(slots.tolist(), records):
        page, i = divmod(s, PAGE)
        flat = pool.storage[page]
        assert torch.equal(flat[i * data_stride:i * data_stride + v4.data_bytes], rec[:v4.data_bytes])
        assert torch.equal(flat[scale_base + i * scale_stride:scale_base + i * scale_stride + v4.scale_bytes],
                           rec[v4.data_bytes:])


def test_tree_rows_decode_as_their_paths(no_flashmla_schedule):
    gen = torch.Generator().manual_seed(2)
    # C4 and C128 blocks close inside the trees (125 -> 128, 380 -> 384), one request crosses a page
    for lens, topk, steps, n in (([125, 380], 3, 3, 8), ([253, 0], 2, 3, 6), ([383, 511], 4, 2, 10)):
        bs = len(lens)
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        req_to_token, mapping = layout(lens, n, gen, extra_rows=1)
        chain_row = req_to_token.shape[0] - 1
        rpi = torch.arange(1, bs + 1, dtype=torch.int32)
        out_loc = torch.cat([req_to_token[r, p:p + n] for r, p in zip(rpi.tolist(), lens)]).to(torch.int64)
        _, rn, rs = sglang_tree(bs, topk, steps, n, seq_lens, gen)
        sb = StandIn(req_to_token, mapping, n)
        raw = dsv4.DSV4RawVerifyMetadata(req_pool_indices=rpi, seq_lens=seq_lens, out_cache_loc=out_loc)
        ours = tree_verify_metadata(sb, raw, rn, rs)
        core, tree = ours.core_attn_metadata, ours.tree
        swa = fp8_pool(int(mapping.max()) + 1, PAGE, gen)
        c128_slots = sb.token_to_kv_pool.c128_size + req_to_token.shape[0] * n  # committed + scratch
        c128 = fp8_pool(c128_slots, PAGE // 128, gen)
        entries = torch.randn(bs * n, D, generator=gen)  # the C128 entry each closing node produces
        closing = torch.nonzero(core.seq_lens_casual % 128 == 0).flatten()
        c128.write(core.c128_out_loc[closing], entries[closing])
        q = torch.randn(bs * n, H, D, generator=gen)
        sinks, scale = torch.randn(H, generator=gen), D ** -0.5
        for b in range(bs):
            P, rid = lens[b], int(rpi[b])
            for i, path in enumerate(paths(tree.parents[b])):
                t, d = b * n + i, len(path) - 1
                chain = path_as_chain(req_to_token, rid, P, path, chain_row)
                ref = StandIn(chain, mapping, n).make_core_attn_metadata(
                    req_to_token=chain, req_pool_indices_repeated=torch.tensor([chain_row], dtype=torch.int32),
                    seq_lens_casual=torch.tensor([P + d + 1], dtype=torch.int32), max_seq_len=chain.shape[1],
                    out_loc=out_loc[t:t + 1], need_compress=True, num_groups=1)
                # the path's own C128 entries, where SGLang's linear metadata reads them
                path_pool = fp8_pool(c128_slots, PAGE // 128)
                path_pool.storage.copy_(c128.storage)
                k0 = P // 128
                for e in range(d + 1):
                    if (P + e + 1) % 128 == 0:
                        k = (P + e + 1) // 128 - 1
                        path_pool.write(ref.c128_page_indices[0, k:k + 1].to(torch.int64), entries[b * n + path[e]][None])
                assert k0 <= (P + d + 1) // 128
                got = ref_sparse_decode(q[t:t + 1], swa, core.swa_page_indices[t:t + 1], core.swa_topk_lengths[t:t + 1],
                                        sinks, scale, c128, core.c128_page_indices[t:t + 1],
                                        core.c128_topk_lengths_clamp1[t:t + 1])
                want = ref_sparse_decode(q[t:t + 1], swa, ref.swa_page_indices, ref.swa_topk_lengths, sinks, scale,
                                         path_pool, ref.c128_page_indices, ref.c128_topk_lengths_clamp1)
                # same keys in the same order through the same ops: bitwise equal
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (lens, b, i)
