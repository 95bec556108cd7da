"""The DSpark tree decode step's verify metadata: trees drafted as the step drafts them
(`dspark_tree_inputs.draft_tree` over SGLang's own V4 Markov head, `tree_verify_input` through
SGLang's tree builder) handed to the tree backend as the batch's spec_info, the way SGLang's
DSpark verify forward hands it (`DSparkTreeVerifyInput`): every verify row's metadata equals
SGLang's own linear (chain) metadata for that node's root-to-node path laid out as a chain on the
same slots (`test_sglang_tree_rows.assert_rows_are_paths`), contexts across pages and C4 / C128
boundaries. SGLang's CUDA tree builder is replaced by its own Triton version (the one it runs on
XPU), under the Triton interpreter."""
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.layers.attention import deepseek_v4_backend as dsv4

from dsv4_tree.sglang_plugin.backend import TreeDeepseekV4AttnBackend
from dsv4_tree.sglang_plugin.dspark_heads import SGLangMarkovHeads
from dsv4_tree.sglang_plugin.dspark_tree_inputs import DSparkTreeVerifyInput, draft_tree, tree_verify_input
from dsv4_tree.sglang_plugin.graph import tree_raw_verify
from dsv4_tree.sglang_plugin.tables import parents_from_retrieve
from plugin_probe import dsv4_dir
from sgl_cases import StandIn, layout
from sgl_dspark import sglang_markov_head, use_triton_tree_kernels
from sgl_pool import published_context
from test_sglang_tree_rows import assert_rows_are_paths

VOCAB, RANK, GAMMA = 300, 8, 5


@pytest.mark.parametrize("topk, n, lens, seed", [
    (4, 8, [255, 40], 0), (4, 10, [127, 508], 1), (2, 6, [3, 767], 2), (3, 9, [383, 124], 3), (4, 5, [0, 250], 4),
    (4, 16, [250, 500], 5)])  # 16: past SGLang's C4 ring bound (windows across a page and a C128 block)
def test_dspark_tree_rows_equal_their_paths_as_chains(monkeypatch, no_flashmla_schedule, tmp_path, topk, n, lens,
                                                      seed):
    from sglang.srt.runtime_context import get_parallel

    gen = torch.Generator().manual_seed(seed)
    use_triton_tree_kernels(monkeypatch)
    with published_context(dsv4_dir(str(tmp_path)), n), get_parallel().override(tp_group=None):
        head = sglang_markov_head(torch.randn(VOCAB, RANK, generator=gen), torch.randn(VOCAB, RANK, generator=gen),
                                  monkeypatch)
    heads = SGLangMarkovHeads(SimpleNamespace(markov_head=head))
    bs = len(lens)
    base = 3 * torch.randn(bs, GAMMA, VOCAB, generator=gen)
    anchors = torch.randint(0, VOCAB, (bs,), generator=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int64)
    drafted = draft_tree(heads, base, torch.zeros(bs, GAMMA, 4), anchors, topk, n)
    vi = tree_verify_input(drafted, anchors, seq_lens, topk, GAMMA, n)
    assert isinstance(vi, DSparkTreeVerifyInput) and vi.retrieve_next_token.shape == (bs, n)
    parents = parents_from_retrieve(vi.retrieve_next_token, vi.retrieve_next_sibling)
    assert (parents[:, 1:] >= 0).all() and (parents[:, 0] == -1).all()  # N nodes, one root per request
    assert vi.draft_token.view(bs, n)[:, 0].tolist() == anchors.tolist()  # the root is the anchor

    req_to_token, mapping = layout(lens, n, gen, extra_rows=1)
    chain_row = req_to_token.shape[0] - 1
    rpi = torch.arange(1, bs + 1, dtype=torch.int32)
    out_loc = torch.cat([req_to_token[r, p:p + n] for r, p in zip(rpi.tolist(), lens)]).to(torch.int64)
    stand_in = StandIn(req_to_token, mapping, n)
    be = object.__new__(TreeDeepseekV4AttnBackend)
    be.__dict__.update(stand_in.__dict__)
    be.topk, be._tree_links, be._tree_draft_out_cache_loc = topk, None, None
    raw = dsv4.DSV4RawVerifyMetadata(req_pool_indices=rpi, seq_lens=seq_lens.to(torch.int32), out_cache_loc=out_loc,
                                     extend_seq_lens=torch.full((bs,), n, dtype=torch.int32),
                                     total_verify_tokens=bs * n)

    def sglang_init(self, forward_batch):  # SGLang's eager TARGET_VERIFY init (its raw record, then the upgrade)
        self.forward_metadata = self.make_forward_metadata_from_raw_verify(tree_raw_verify(raw, self._tree_links))

    monkeypatch.setattr(dsv4.DeepseekV4AttnBackend, "init_forward_metadata", sglang_init)
    monkeypatch.setattr(dsv4, "_get_logical_forward_mode", lambda fb: fb.forward_mode)
    verify = SimpleNamespace(is_target_verify=lambda: True, is_decode=lambda: False)
    batch = SimpleNamespace(forward_mode=verify, out_cache_loc=out_loc, batch_size=bs, seq_lens=raw.seq_lens,
                            spec_info=vi)
    be.init_forward_metadata(batch)
    ours = be.forward_metadata
    # the rows' positions are the verify input's (P + depth), which SGLang's verify forward feeds the model
    assert torch.equal(ours.core_attn_metadata.positions_casual.to(torch.int64), vi.positions)
    assert torch.equal(ours.tree.parents.to(torch.int64), parents.to(torch.int64))
    assert_rows_are_paths(ours, req_to_token, mapping, rpi, lens, out_loc, n, chain_row)


def test_the_dspark_tree_step_drafts_without_a_host_read(monkeypatch, no_flashmla_schedule, tmp_path):
    """Between the draft backbone pass and the verify forward the tree step reads nothing on the
    host: the Markov expansion (fixed shapes, no dedupe) and SGLang's organize_draft_results run
    under a captured region's rules (no host read, no host data), and SGLang's tree builder (its
    Triton version here) under forbid_host_sync."""
    from sglang.srt.runtime_context import get_parallel

    from dsv4_tree.diagnostics import forbid_host_sync
    from sgl_graph import captured

    gen = torch.Generator().manual_seed(7)
    use_triton_tree_kernels(monkeypatch)
    with published_context(dsv4_dir(str(tmp_path)), 8), get_parallel().override(tp_group=None):
        head = sglang_markov_head(torch.randn(VOCAB, RANK, generator=gen), torch.randn(VOCAB, RANK, generator=gen),
                                  monkeypatch)
    heads = SGLangMarkovHeads(SimpleNamespace(markov_head=head))
    base = 3 * torch.randn(3, GAMMA, VOCAB, generator=gen)
    anchors = torch.randint(0, VOCAB, (3,), generator=gen)
    with captured():
        drafted = draft_tree(heads, base, torch.zeros(3, GAMMA, 4), anchors, 4, 8)
    with forbid_host_sync():
        vi = tree_verify_input(drafted, anchors, torch.tensor([40, 300, 7]), 4, GAMMA, 8)
    assert vi.retrieve_next_token.shape == (3, 8)
    assert drafted.draft_tokens.shape == (3, 7)
