"""EAGLE topk > 1 draft decode under SGLang 0.5.23's CUDA-graph protocol, on the CPU: SGLang's
own multi-step `init_cuda_graph_state`, capture (`init_forward_metadata_out_graph(in_capture=True)`
for every step backend, then the captured `init_forward_metadata_in_graph`) and replay (step 0's
out-of-graph prep, its record copied into the later steps' records). Every replayed step's
metadata, built by the captured function on the capture's inputs (no host read, no host data,
the capture's shapes), equals the eager multi-step path's for the same padded batch."""
from types import SimpleNamespace

import torch
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from dsv4_tree.sglang_plugin.backend import TreeDeepseekV4AttnBackend, TreeDeepseekV4MultiStepBackend
from dsv4_tree.sglang_plugin.graph import TreeRawDecodeMetadata
from sgl_cases import StandIn, layout
from sgl_graph import RunnerBuffers, captured, graph_backend, ptrs_of, shapes_of, tensors_of

TOPK, STEPS, N, SIZES = 3, 3, 8, (1, 2, 4)


def multistep(req_to_token, mapping):
    sb = StandIn(req_to_token, mapping, N)
    sb.present_ratios = sb.low_ratios = ()
    sb.has_c4 = sb.has_c128 = False
    ms = object.__new__(TreeDeepseekV4MultiStepBackend)
    ms.topk, ms.speculative_num_steps = TOPK, STEPS
    ms.attn_backends = [graph_backend(TreeDeepseekV4AttnBackend, sb, topk=TOPK, steps=STEPS, step=i, draft=True)
                        for i in range(STEPS)]
    return ms


def draft_batch(bs, rpi, seq_lens, out_cache_loc):
    return SimpleNamespace(forward_mode=ForwardMode.DECODE, batch_size=bs, req_pool_indices=rpi, seq_lens=seq_lens,
                           seq_lens_cpu=None, seq_lens_sum=None, max_seq_len_override=None,
                           out_cache_loc=out_cache_loc, positions=torch.zeros(bs * TOPK, dtype=torch.int64),
                           spec_info=None, input_ids=None, encoder_swa_replay=False, encoder_swa_row_floor=None)


def draft_slots(req_to_token, rpi, lens, bs):
    """Distinct write slots (bs, topk, steps) past each real request's prefix, 0 for padding."""
    out = torch.zeros(bs, TOPK, STEPS, dtype=torch.int64)
    for b, (r, p) in enumerate(zip(rpi.tolist(), lens)):
        out[b] = req_to_token[r, p + 256:p + 256 + TOPK * STEPS].view(TOPK, STEPS)
    return out.view(-1)


def test_draft_replay_equals_eager_every_step(no_flashmla_schedule):
    gen = torch.Generator().manual_seed(79)
    req_to_token, mapping = layout([0, 0, 0], N, gen, max_len=2048)
    req_to_token[0] = 0  # SGLang's padding row
    ms = multistep(req_to_token, mapping)
    ms.init_cuda_graph_state(max(SIZES), max(SIZES) * TOPK)
    bufs = RunnerBuffers(max(SIZES), max(SIZES) * TOPK * STEPS)
    graphs = {}
    for bs in SIZES:
        fb = draft_batch(bs, bufs.req_pool_indices[:bs], bufs.seq_lens[:bs], bufs.out_cache_loc[:bs * TOPK * STEPS])
        ms.init_forward_metadata_out_graph(fb, in_capture=True)
        records = [be.forward_metadata for be in ms.attn_backends]
        assert all(isinstance(r, TreeRawDecodeMetadata) for r in records)
        with captured():
            ms.init_forward_metadata_in_graph(fb)
        graphs[bs] = (records, [ptrs_of(r) for r in records],
                      [shapes_of(be.forward_metadata) for be in ms.attn_backends], fb)
    for trial in range(4):
        raw_bs = 1 + trial % 3
        bs = min(s for s in SIZES if s >= raw_bs)
        lens = [int(x) for x in torch.randint(1, 1200, (raw_bs,), generator=gen)]
        rpi = (torch.randperm(3, generator=gen)[:raw_bs] + 1).to(torch.int32)
        loc = draft_slots(req_to_token, rpi, lens, bs)
        label = f"{trial=} {raw_bs=} {bs=} {lens=}"
        prpi, pseq = bufs.load(rpi, torch.tensor(lens, dtype=torch.int32), bs, loc)
        ms.init_forward_metadata_out_graph(draft_batch(bs, prpi, pseq, bufs.out_cache_loc[:bs * TOPK * STEPS]))
        records, ptrs, shapes, capture_fb = graphs[bs]
        for i in range(STEPS - 1):  # SGLang replays the steps that run (the last step's backend runs none)
            be = ms.attn_backends[i]
            assert be.forward_metadata is records[i] and ptrs_of(records[i]) == ptrs[i], (label, i)
            assert torch.equal(records[i].draft_out_cache_loc, loc), (label, i)
        with captured():
            ms.init_forward_metadata_in_graph(capture_fb)
        replayed = [be.forward_metadata for be in ms.attn_backends]
        ms.init_forward_metadata(draft_batch(bs, prpi.clone(), pseq.clone(), loc.clone()))
        for i in range(STEPS - 1):
            assert shapes_of(replayed[i]) == shapes[i], (label, i)
            got, want = tensors_of(replayed[i]), tensors_of(ms.attn_backends[i].forward_metadata)
            assert sorted(got) == sorted(want), (label, i)
            for k in want:
                assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), (label, i, k)
            pad = slice(raw_bs * TOPK, bs * TOPK)  # padding rows write SGLang's slot 0 only
            assert bool((replayed[i].core_attn_metadata.raw_out_loc[pad] == 0).all()), (label, i)
