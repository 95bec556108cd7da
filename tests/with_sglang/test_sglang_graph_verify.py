"""Target verify under SGLang 0.5.23's CUDA-graph protocol, on the CPU: `init_cuda_graph_state`,
the capture of each batch size (`init_forward_metadata_out_graph(in_capture=True)`, then the
captured `init_forward_metadata_in_graph`), and replays of random trees padded to each captured
size. The out-of-graph prep must copy into the record captured for the size (same tensors, same
addresses); the captured build, run on the capture's inputs, must make no host read, take no host
data, keep the capture's shapes, and fill the metadata the eager path builds for the same padded
batch, field for field; the real rows equal SGLang's linear metadata of their paths, the padding
rows write only SGLang's padding slot 0."""

import pytest
import torch

from dsv4_tree.errors import StateError
from dsv4_tree.sglang_plugin.backend import TreeDeepseekV4AttnBackend
from dsv4_tree.sglang_plugin.graph import TreeRawVerifyMetadata
from sgl_cases import StandIn, layout, sglang_tree
from sgl_graph import (RunnerBuffers, captured, graph_backend, no_host_data, ptrs_of, shapes_of, tensors_of,
                       verify_batch, verify_spec)
from test_sglang_tree_rows import assert_rows_are_paths

N, TOPK, STEPS, SIZES = 8, 3, 3, (1, 2, 4)


def capture_all(be, bufs):
    be.init_cuda_graph_state(max(SIZES), max(SIZES) * N)
    graphs = {}
    for bs in SIZES:
        fb = verify_batch(bs, bufs.req_pool_indices[:bs], bufs.seq_lens[:bs], bufs.out_cache_loc[:bs * N],
                          verify_spec(None, None))
        be.init_forward_metadata_out_graph(fb, in_capture=True)
        record = be.forward_metadata
        assert isinstance(record, TreeRawVerifyMetadata) and record.retrieve_next_token.shape == (bs, N)
        with captured():
            be.init_forward_metadata_in_graph(fb)
        graphs[bs] = (record, ptrs_of(record), shapes_of(be.forward_metadata), fb)
    return graphs


def eager(be, rpi, seq_lens, out_loc, spec_info, bs):
    """The eager path on the same padded batch (SGLang's DP padding: row 0, length 1, slot 0)."""
    pad = bs * N - out_loc.shape[0]
    loc = torch.cat([out_loc, torch.zeros(pad, dtype=out_loc.dtype)])
    be.init_forward_metadata(verify_batch(bs, rpi.clone(), seq_lens.clone(), loc, spec_info))
    return be.forward_metadata


def test_replay_fills_the_captured_record_as_eager_builds(no_flashmla_schedule):
    gen = torch.Generator().manual_seed(71)
    req_to_token, mapping = layout([0, 0, 0], N, gen, extra_rows=1, max_len=1024)
    req_to_token[0] = 0  # SGLang's padding row: never handed out, zeros from allocation
    chain_row = req_to_token.shape[0] - 1
    be = graph_backend(TreeDeepseekV4AttnBackend, StandIn(req_to_token, mapping, N), topk=TOPK)
    bufs = RunnerBuffers(max(SIZES), max(SIZES) * N)
    graphs = capture_all(be, bufs)
    seen = set()
    for trial in range(6):
        raw_bs = 1 + trial % 3
        bs = min(s for s in SIZES if s >= raw_bs)
        lens = [int(x) for x in torch.randint(0, 900, (raw_bs,), generator=gen)]
        lens[0] = [127, 255, 381, 3, 508, 0][trial]  # C4 / C128 blocks close inside the window
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        rpi = (torch.randperm(3, generator=gen)[:raw_bs] + 1).to(torch.int32)
        _, rn, rs = sglang_tree(raw_bs, TOPK, STEPS, N, seq_lens, gen)
        out_loc = torch.cat([req_to_token[r, p:p + N] for r, p in zip(rpi.tolist(), lens)]).to(torch.int64)
        spec = verify_spec(rn, rs)
        label = f"{trial=} {raw_bs=} {bs=} {lens=}"
        # replay: out of graph, then the graph (the captured build on the capture's inputs)
        prpi, pseq = bufs.load(rpi, seq_lens, bs, out_loc)
        be.init_forward_metadata_out_graph(verify_batch(bs, prpi, pseq, out_loc, spec))
        record, ptrs, shapes, capture_fb = graphs[bs]
        assert be.forward_metadata is record and ptrs_of(record) == ptrs, label  # copied in, not rebound
        with captured():
            be.init_forward_metadata_in_graph(capture_fb)
        replayed = be.forward_metadata
        assert shapes_of(replayed) == shapes, label  # the bucket fixes every shape
        want = eager(be, prpi, pseq, out_loc, spec, bs)
        got_t, want_t = tensors_of(replayed), tensors_of(want)
        assert sorted(got_t) == sorted(want_t), label
        for k in want_t:
            g, w = got_t[k], want_t[k]
            if k.endswith("raw_out_loc"):  # SGLang's capture record holds int32 slots, eager the batch's int64
                g, w = g.long(), w.long()
            assert g.dtype == w.dtype and torch.equal(g, w), f"{label} {k}"
        assert_rows_are_paths(replayed, req_to_token, mapping, rpi, lens, out_loc, N, chain_row)
        core, tree = replayed.core_attn_metadata, replayed.tree
        pad = slice(raw_bs * N, bs * N)  # padding rows: SGLang's padding row 0, slot 0, nothing else
        assert bool((tree.req_pool_indices_repeated[pad] == 0).all()), label
        for loc in (core.raw_out_loc, core.c4_out_loc, core.c128_out_loc, tree.c4_branch, tree.c128_branch):
            assert bool((loc[pad] <= 0).all()), label
        swa = core.swa_page_indices[pad]
        assert bool(((swa == -1) | (swa == int(mapping[0]))).all()), label
        seen.add(bs)
    assert seen == set(SIZES)


def test_replay_of_an_uncaptured_tree_width_is_refused(no_flashmla_schedule):
    gen = torch.Generator().manual_seed(73)
    req_to_token, mapping = layout([0, 0], N, gen, max_len=1024)
    be = graph_backend(TreeDeepseekV4AttnBackend, StandIn(req_to_token, mapping, N), topk=TOPK)
    bufs = RunnerBuffers(2, 2 * N)
    rn, rs = torch.full((1, N + 1), -1), torch.full((1, N + 1), -1)
    prpi, pseq = bufs.load(torch.tensor([1], dtype=torch.int32), torch.tensor([40], dtype=torch.int32), 1,
                           req_to_token[1, 40:40 + N].long())
    spec = verify_spec(rn, rs)
    be.init_cuda_graph_state(2, 2 * N)
    with pytest.raises(StateError, match="speculative_num_draft_tokens"):
        be.init_forward_metadata_out_graph(verify_batch(1, prpi, pseq, req_to_token[1, 40:40 + N].long(), spec))


def test_the_host_data_guard_sees_a_host_value():
    with pytest.raises(StateError, match="host data"):
        with no_host_data():
            torch.tensor([1, 2])
