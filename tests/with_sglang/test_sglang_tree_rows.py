"""In a tree, each verify row's metadata equals SGLang 0.5.23's own linear (chain) metadata for
that node's root-to-node path laid out as a chain on the same slots. Trees come from SGLang's
own draft pipeline (select_top_k_tokens, organize_draft_results, sgl_build_tree_kernel_triton);
contexts cross pages and C4 / C128 boundaries."""
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sglang.srt.layers.attention import deepseek_v4_backend as dsv4

from dsv4_tree.sglang_plugin.metadata import tree_verify_metadata
from sgl_cases import PAGE, StandIn, layout, path_as_chain, same, sglang_tree

EQUAL_ROW_FIELDS = ("seq_lens_casual", "positions_casual", "swa_page_indices", "swa_topk_lengths",
                    "c4_topk_lengths_raw", "c4_topk_lengths_clamp1", "c4_sparse_topk_lengths",
                    "c128_topk_lengths_clamp1")
BOUNDARY = st.sampled_from([0, 1, 2, 3, 124, 125, 126, 127, 128, 250, 253, 254, 255, 256, 380, 383, 508, 511, 767])


def paths(parents: torch.Tensor) -> list[list[int]]:
    out = []
    for i in range(parents.shape[0]):
        path = [i]
        while parents[path[-1]] >= 0:
            path.append(int(parents[path[-1]]))
        out.append(path[::-1])  # root first
    return out


# the fixture's patch is the same for every example (it is undone after the test), so running
# it once per test rather than per example is what is wanted
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(bs=st.integers(1, 2), topk=st.integers(2, 4), steps=st.integers(1, 3), n_frac=st.floats(0, 1),
       lens=st.lists(st.one_of(BOUNDARY, st.integers(0, 900)), min_size=2, max_size=2), seed=st.integers(0, 2**16))
def test_tree_rows_equal_their_paths_as_chains(no_flashmla_schedule, bs, topk, steps, n_frac, lens, seed):
    gen = torch.Generator().manual_seed(seed)
    most = min(10, 1 + topk + (steps - 1) * topk * topk)
    n = 2 + int(n_frac * (most - 2))
    seq_lens = torch.tensor(lens[:bs], dtype=torch.int32)
    req_to_token, mapping = layout(lens[:bs], n, gen, extra_rows=1)
    chain_row = req_to_token.shape[0] - 1
    rpi = torch.arange(1, bs + 1, dtype=torch.int32).flip(0)
    out_loc = torch.cat([req_to_token[r, p:p + n] for r, p in zip(rpi.tolist(), lens)]).to(torch.int64)
    positions, rn, rs = sglang_tree(bs, topk, steps, n, seq_lens, gen)
    sb = StandIn(req_to_token, mapping, n)
    raw = dsv4.DSV4RawVerifyMetadata(req_pool_indices=rpi, seq_lens=seq_lens, out_cache_loc=out_loc,
                                     extend_seq_lens=torch.full((bs,), n, dtype=torch.int32), total_verify_tokens=bs * n)
    ours = tree_verify_metadata(sb, raw, rn, rs)
    assert torch.equal(ours.core_attn_metadata.positions_casual.to(torch.int64), positions)  # SGLang's own
    assert_rows_are_paths(ours, req_to_token, mapping, rpi, lens[:bs], out_loc, n, chain_row)


def assert_rows_are_paths(ours, req_to_token, mapping, rpi, lens, out_loc, n: int, chain_row: int) -> None:
    """Every real row of tree metadata `ours` (requests rpi at P = lens, N nodes) equals SGLang's
    linear metadata of its root-to-node path laid out as a chain on row `chain_row`."""
    bs = len(lens)
    core, tree = ours.core_attn_metadata, ours.tree
    out_loc = out_loc.to(torch.int64)
    for m, out, branch in ((4, core.c4_out_loc, tree.c4_branch), (128, core.c128_out_loc, tree.c128_branch)):
        closing = (core.seq_lens_casual[:bs * n] % m == 0)  # real rows (padding rows all write slot 0)
        written = out[:bs * n][closing]
        assert written.unique().numel() == written.numel(), f"two closing rows share a C{m} slot"
    for b in range(bs):
        P, rid = lens[b], int(rpi[b])
        for i, path in enumerate(paths(tree.parents[b])):
            t, d = b * n + i, len(path) - 1
            chain = path_as_chain(req_to_token, rid, P, path, chain_row)
            cb = StandIn(chain, mapping, n)
            ref = cb.make_core_attn_metadata(
                req_to_token=chain, req_pool_indices_repeated=torch.tensor([chain_row], dtype=torch.int32),
                seq_lens_casual=torch.tensor([P + d + 1], dtype=torch.int32), max_seq_len=cb.MAX_SEQ_LEN_FOR_CAPTURE,
                out_loc=out_loc[t:t + 1], need_compress=True, num_groups=1)
            ref_idx = cb.init_forward_metadata_indexer(ref)
            for f in EQUAL_ROW_FIELDS:
                assert same(getattr(core, f)[t:t + 1], getattr(ref, f)), (b, i, f)
            committed_pages = -(-P // PAGE)  # page-table columns whose first position is committed
            assert torch.equal(core.page_table[t, :committed_pages], ref.page_table[0, :committed_pages])
            assert torch.equal(ours.indexer_metadata.compressed_seq_lens[t:t + 1], ref_idx.compressed_seq_lens)
            assert torch.equal(ours.indexer_metadata.page_table[t, :committed_pages],
                               ref_idx.page_table[0, :committed_pages])
            for m, out, ref_out in ((4, core.c4_out_loc, ref.c4_out_loc), (128, core.c128_out_loc, ref.c128_out_loc)):
                assert bool(out[t] != 0) == bool(ref_out[0] != 0), (b, i, m)  # the same rows close blocks
                # the row's branch entries are those its own ancestors wrote, in block order
                want = [int(out[b * n + path[e]]) for e in range(d + 1) if (P + e + 1) % m == 0]
                got = tree.c4_branch[t] if m == 4 else tree.c128_branch[t]
                assert got[got >= 0].tolist() == want, (b, i, m)
            k0, k1 = P // 128, (P + d + 1) // 128
            assert torch.equal(core.c128_page_indices[t, :k0], ref.c128_page_indices[0, :k0])
            assert core.c128_page_indices[t, k0:k1].tolist() == tree.c128_branch[t, :k1 - k0].tolist()
            assert torch.equal(core.c128_page_indices[t, k1:], ref.c128_page_indices[0, k1:])
