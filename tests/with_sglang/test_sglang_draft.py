"""EAGLE topk > 1 draft decode in SGLang 0.5.23's DeepSeek-V4 multi-step backend: the write
slots come from SGLang's own `prepare_for_draft` (per-branch page-aligned regions for page size
256); the tree multi-step backend's metadata is built through SGLang's own eager call order
(`DeepseekV4MultiStepBackend.init_forward_metadata` -> each step backend's
`init_forward_metadata` -> `_build_forward_metadata` -> `init_forward_metadata_in_graph`).

Each branch row of each step must equal SGLang's own linear decode metadata
(`make_forward_metadata_from_raw_decode`) for that branch laid out as a chain: the committed
prefix, then the branch's own draft slots of steps 0 .. i; and the slots it reads must be the
newest `SWA_WINDOW` of what SGLang's paged topk > 1 draft reader (`generate_draft_decode_kv_indices`,
the Triton backend's) gives that branch."""
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sglang.kernels.ops.speculative.cache_locs import generate_draft_decode_kv_indices
from sglang.srt.layers.attention import deepseek_v4_backend as dsv4
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.speculative import eagle_worker_common
from sglang.srt.speculative.eagle_utils import per_step_draft_out_cache_loc
from sgl_graph import NoOnlineC128

from dsv4_tree.errors import ConfigError, StateError
from dsv4_tree.sglang_plugin.backend import TreeDeepseekV4AttnBackend, TreeDeepseekV4MultiStepBackend
from sgl_cases import PAGE, StandIn, layout, same

MAX_LEN = 4096
DRAFT_FIELDS = ("seq_lens_casual", "positions_casual", "swa_page_indices", "swa_topk_lengths", "raw_out_loc",
                "c4_sparse_page_indices", "c4_out_loc", "c128_out_loc", "c128_page_indices")
BOUNDARY = st.sampled_from([1, 2, 5, 126, 127, 128, 129, 200, 251, 253, 254, 255, 256, 257, 383, 509, 511, 512, 700])


class _RecordingDraftPool:
    """The draft pool as prepare_for_draft sees it: records duplicate_prefix_tail_to_draft_branches' moves."""

    def __init__(self):
        self.moves = []

    def move_kv_cache(self, tgt, src):
        self.moves.append((tgt.clone(), src.clone()))


def sglang_draft_out_cache_loc(monkeypatch, req_to_token, rpi, seq_lens, topk, steps):
    """SGLang's own prepare_for_draft (page 256, topk > 1) on stand-in batch objects ->
    (out_cache_loc [bs * topk * steps], positions [bs * topk], the draft pool's recorded moves)."""
    captured = {}

    class FB:
        @staticmethod
        def init_new(batch, runner, **kw):
            captured["out_cache_loc"] = batch.out_cache_loc
            return SimpleNamespace(out_cache_loc=batch.out_cache_loc)

    monkeypatch.setattr(eagle_worker_common, "ForwardBatch", FB)
    draft_pool = _RecordingDraftPool()
    batch = SimpleNamespace(forward_mode=ForwardMode.DECODE, seq_lens=seq_lens, req_pool_indices=rpi,
                            token_to_kv_pool_allocator=SimpleNamespace(page_size=PAGE), device="cpu",
                            multimodal_inputs=[None] * len(seq_lens))
    runner = SimpleNamespace(token_to_kv_pool=draft_pool, spec_algorithm=SimpleNamespace(is_standalone=lambda: False),
                             model_config=SimpleNamespace(model_is_mrope=False))
    draft_input = SimpleNamespace()
    eagle_worker_common.prepare_for_draft(draft_input, SimpleNamespace(req_to_token=req_to_token), batch, None,
                                          runner, topk, steps)
    return captured["out_cache_loc"], draft_input.positions, draft_pool.moves


def draft_stand_in(req_to_token, mapping, n) -> StandIn:
    """What SGLang's backend methods read of `self` for the DeepSeek-V4 draft (MTP) pool: SWA
    only (the MTP layer's compress ratio is 0, so the pool has no compressed ratios)."""
    sb = StandIn(req_to_token, mapping, n)
    sb.present_ratios = sb.low_ratios = ()
    sb.has_c4 = sb.has_c128 = False
    sb.req_to_token_pool = SimpleNamespace(req_to_token=req_to_token)
    sb.online_c128_mtp = NoOnlineC128()
    sb.mtp_enabled = True
    sb.enable_decoder_swa_bounded_replay = False
    sb._early_verify_metadata_ids = set()
    sb.token_to_kv_pool.translate_loc_from_full_to_swa = lambda loc: mapping[loc]
    sglang_decode = dsv4.DeepseekV4AttnBackend.make_forward_metadata_from_raw_decode
    sb.make_forward_metadata_from_raw_decode = sglang_decode.__get__(sb)
    return sb


def tree_multistep(req_to_token, mapping, n, topk, steps) -> TreeDeepseekV4MultiStepBackend:
    """The plug-in's multi-step backend with its step backends, over the stand-in's state."""
    ms = object.__new__(TreeDeepseekV4MultiStepBackend)
    ms.topk, ms.speculative_num_steps, ms.attn_backends = topk, steps, []
    for i in range(steps):
        be = object.__new__(TreeDeepseekV4AttnBackend)
        be.__dict__.update(vars(draft_stand_in(req_to_token, mapping, n)))
        be.__dict__.pop("make_forward_metadata_from_raw_decode")
        be.topk, be.speculative_num_steps, be.speculative_step_id = topk, steps, i
        be._tree_spec_info = be._tree_draft_out_cache_loc = None
        ms.attn_backends.append(be)
    return ms


def draft_batch(rpi, seq_lens, out_cache_loc, positions):
    return SimpleNamespace(forward_mode=ForwardMode.DECODE, batch_size=len(seq_lens), req_pool_indices=rpi,
                           seq_lens=seq_lens, seq_lens_cpu=None, max_seq_len_override=None, out_cache_loc=out_cache_loc,
                           positions=positions, spec_info=None, encoder_swa_replay=False, encoder_swa_row_floor=None)


def sglang_paged_draft_reads(req_to_token, rpi, seq_lens, topk, steps) -> list:
    """SGLang's paged topk > 1 draft-decode reader (Triton, interpreted on the CPU): per step,
    per row b * topk + t, the full-pool slots the branch reads, oldest first."""
    bs = len(seq_lens)
    rows = bs * topk
    width = int(seq_lens.sum()) * topk + rows * steps
    kv_indices = torch.full((steps, width), -7, dtype=torch.int64)
    kv_indptr = torch.zeros((steps, rows + 1), dtype=torch.int32)
    positions = seq_lens.to(torch.int64).repeat_interleave(topk)
    pow2 = lambda x: 1 << max(0, (x - 1).bit_length())  # noqa: E731
    generate_draft_decode_kv_indices[(steps, bs, topk)](
        rpi, req_to_token, seq_lens, kv_indices, kv_indptr, positions, req_to_token.shape[1], width, rows + 1,
        pow2(bs), pow2(steps), pow2(rows), PAGE)
    return [[kv_indices[i, int(kv_indptr[i, r]):int(kv_indptr[i, r + 1])] for r in range(rows)] for i in range(steps)]


def check_draft_case(monkeypatch, lens, topk, steps, seed, rpi_order=None):
    gen = torch.Generator().manual_seed(seed)
    bs = len(lens)
    n = min(10, topk * steps)
    req_to_token, mapping = layout(lens, n, gen, extra_rows=1, max_len=MAX_LEN)
    chain_row = req_to_token.shape[0] - 1
    rpi = torch.tensor(rpi_order or list(range(1, bs + 1)), dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    out_cache_loc, positions, moves = sglang_draft_out_cache_loc(monkeypatch, req_to_token, rpi, seq_lens, topk, steps)
    assert out_cache_loc.shape == (bs * topk * steps,) and out_cache_loc.unique().numel() == bs * topk * steps
    ms = tree_multistep(req_to_token, mapping, n, topk, steps)
    ms.init_forward_metadata(draft_batch(rpi, seq_lens, out_cache_loc, positions))
    reads = sglang_paged_draft_reads(req_to_token, rpi, seq_lens, topk, steps)
    per_step = per_step_draft_out_cache_loc(out_cache_loc, bs, topk, steps)
    own = out_cache_loc.view(bs, topk, steps)
    chain_be = draft_stand_in(req_to_token, mapping, n)
    for i in range(steps - 1):  # SGLang's draft forwards steps 0 .. steps - 2 (the last only samples)
        be = ms.attn_backends[i]
        assert be._tree_draft_out_cache_loc is None  # not kept past the call
        core = be.forward_metadata.core_attn_metadata
        assert be.forward_metadata.indexer_metadata is None and be.forward_metadata.c4_compress_metadata is None
        assert torch.equal(core.swa_out_cache_loc, mapping[per_step[i]].to(torch.int32))  # SGLang's write slot per row
        for b in range(bs):
            P, rid = lens[b], int(rpi[b])
            for t in range(topk):
                r, L = b * topk + t, P + i + 1
                chain = req_to_token.clone()
                chain[chain_row, :P] = req_to_token[rid, :P]
                chain[chain_row, P:L] = own[b, t, :i + 1].to(torch.int32)
                chain_be.req_to_token = chain
                ref = chain_be.make_forward_metadata_from_raw_decode(dsv4.DSV4RawDecodeMetadata(
                    req_pool_indices=torch.tensor([chain_row], dtype=torch.int32),
                    seq_lens=torch.tensor([L], dtype=torch.int32), out_cache_loc=own[b, t, i:i + 1])).core_attn_metadata
                msg = f"{lens=} {topk=} {steps=} {seed=} step={i} {b=} {t=}"
                for f in DRAFT_FIELDS:
                    got, want = getattr(core, f), getattr(ref, f)
                    assert same(got if got is None else got[r:r + 1], want), (msg, f)
                pages = -(-L // PAGE)  # page-table columns whose first position the row holds
                assert torch.equal(core.page_table[r, :pages], ref.page_table[0, :pages]), msg
                # the newest SWA_WINDOW slots of SGLang's paged topk > 1 reader for this branch, newest first
                read = reads[i][r]
                assert read.numel() == L, msg
                newest = mapping[read[-min(L, dsv4.SWA_WINDOW):].flip(0)].to(torch.int32)
                assert torch.equal(core.swa_page_indices[r, :newest.numel()], newest), msg
                assert core.swa_page_indices[r, 0] == core.swa_out_cache_loc[r], msg  # reads what it writes
    return moves


@pytest.mark.parametrize("lens, topk, steps", [
    ([253, 40], 4, 5),  # branch 0 crosses into a new page at step 3; a short prefix
    ([127, 128, 129], 2, 3),  # the SWA window fills and slides
    ([511, 256], 3, 4),  # a page-aligned prefix (no holes) beside a page's last slot
])
def test_draft_branches_equal_their_chains(monkeypatch, no_flashmla_schedule, lens, topk, steps):
    moves = check_draft_case(monkeypatch, lens, topk, steps, seed=sum(lens) + topk)
    # SGLang copies the prefix tail into branch pages for page-granular readers; these rows do
    # not read the copies (prefix positions come from the request's own slots)
    assert len(moves) == (1 if any(p % PAGE for p in lens) else 0)


@settings(max_examples=12, deadline=None)
@given(lens=st.lists(st.one_of(BOUNDARY, st.integers(1, 900)), min_size=1, max_size=3), topk=st.integers(2, 4),
       steps=st.integers(2, 5), seed=st.integers(0, 2**16), flip=st.booleans())
def test_draft_branches_equal_their_chains_random(lens, topk, steps, seed, flip):
    with pytest.MonkeyPatch.context() as mp:
        # see conftest: an opaque CUDA handle, no field reads it (undone when the example ends)
        mp.setattr(dsv4, "_create_flashmla_metadata", lambda: None)
        order = list(range(len(lens), 0, -1)) if flip else None
        check_draft_case(mp, lens, topk, steps, seed, rpi_order=order)


def test_draft_decode_refusals(no_flashmla_schedule):
    gen = torch.Generator().manual_seed(3)
    req_to_token, mapping = layout([300, 20], 8, gen, max_len=MAX_LEN)
    ms = tree_multistep(req_to_token, mapping, 8, 4, 3)
    be = ms.attn_backends[0]
    rpi, seq_lens = torch.tensor([1, 2], dtype=torch.int32), torch.tensor([300, 20], dtype=torch.int32)
    with pytest.raises(StateError, match=r"8 write slots \(bs \* topk\), got 2 and 2"):
        be.init_forward_metadata_decode(0, rpi, seq_lens, torch.zeros(2, dtype=torch.int64))
    raw = be.init_forward_metadata_decode(0, rpi, seq_lens, torch.zeros(8, dtype=torch.int64))
    with pytest.raises(StateError, match="bs \\* topk \\* num_steps = 24 slots, got None"):
        be.make_forward_metadata_from_raw_decode(raw)
    be._tree_draft_out_cache_loc = torch.zeros(24, dtype=torch.int64)  # the record keeps the multi-step slots
    raw = be.init_forward_metadata_decode(0, rpi, seq_lens, torch.zeros(8, dtype=torch.int64))
    be.present_ratios = (4, 128)
    with pytest.raises(ConfigError, match=r"compressed ratios \(4, 128\)"):
        be.make_forward_metadata_from_raw_decode(raw)


def test_draft_branch_attention_equals_the_branch_run_alone(monkeypatch, no_flashmla_schedule):
    """Numerically, over an fp8 SWA pool in SGLang's V4 byte layout: every step each row writes a
    new record to its SGLang write slot and decodes with the tree metadata; each branch's outputs
    are bitwise those of the branch run alone (a pool holding only the prefix and that branch's
    own records) with SGLang's linear decode metadata."""
    from dsv4_tree.reference import ref_sparse_decode
    from test_sglang_decode import D, H, fp8_pool

    gen = torch.Generator().manual_seed(11)
    lens, topk, steps = [253, 60], 3, 4
    bs, n = len(lens), 10
    req_to_token, mapping = layout(lens, n, gen, extra_rows=1, max_len=MAX_LEN)
    chain_row = req_to_token.shape[0] - 1
    rpi, seq_lens = torch.arange(1, bs + 1, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)
    out_cache_loc, positions, _ = sglang_draft_out_cache_loc(monkeypatch, req_to_token, rpi, seq_lens, topk, steps)
    ms = tree_multistep(req_to_token, mapping, n, topk, steps)
    ms.init_forward_metadata(draft_batch(rpi, seq_lens, out_cache_loc, positions))
    pool = fp8_pool(int(mapping.max()) + 1, PAGE, gen)  # random records stand for everything already there
    before = pool.storage.clone()
    sinks, scale = torch.randn(H, generator=gen), D ** -0.5
    written, queries, outs = [], [], []
    for i in range(steps - 1):
        core = ms.attn_backends[i].forward_metadata.core_attn_metadata
        written.append(torch.randn(bs * topk, D, generator=gen))
        pool.write(core.swa_out_cache_loc.to(torch.int64), written[-1])
        queries.append(torch.randn(bs * topk, H, D, generator=gen))
        outs.append(ref_sparse_decode(queries[-1], pool, core.swa_page_indices, core.swa_topk_lengths, sinks, scale))
    own = out_cache_loc.view(bs, topk, steps)
    chain_be = draft_stand_in(req_to_token, mapping, n)
    for b in range(bs):
        P, rid = lens[b], int(rpi[b])
        for t in range(topk):
            r = b * topk + t
            alone = fp8_pool(int(mapping.max()) + 1, PAGE)
            alone.storage.copy_(before)
            for i in range(steps - 1):
                alone.write(mapping[own[b, t, i:i + 1].long()], written[i][r:r + 1])
                chain = req_to_token.clone()
                chain[chain_row, :P] = req_to_token[rid, :P]
                chain[chain_row, P:P + i + 1] = own[b, t, :i + 1].to(torch.int32)
                chain_be.req_to_token = chain
                ref = chain_be.make_forward_metadata_from_raw_decode(dsv4.DSV4RawDecodeMetadata(
                    req_pool_indices=torch.tensor([chain_row], dtype=torch.int32),
                    seq_lens=torch.tensor([P + i + 1], dtype=torch.int32),
                    out_cache_loc=own[b, t, i:i + 1])).core_attn_metadata
                want = ref_sparse_decode(queries[i][r:r + 1], alone, ref.swa_page_indices, ref.swa_topk_lengths,
                                         sinks, scale)
                # same keys in the same order through the same ops: bitwise equal
                assert torch.equal(outs[i][0][r:r + 1], want[0]) and torch.equal(outs[i][1][r:r + 1], want[1]), \
                    (lens, b, t, i)
