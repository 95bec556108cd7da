"""A full EAGLE topk > 1 round on SGLang 0.5.23's own DeepSeekV4TokenToKVPool, driven through the
CUDA-graph replay path (SGLang's capture of the batch size, the out-of-graph prep, the captured
metadata build on the capture's inputs), against the same round on the eager path, bit for bit:
the draft steps' metadata and their SWA writes into a draft pool, the verify's SWA records,
C4 / C128 entries, indexer keys and compressor state rows, SGLang's greedy acceptance and the
commit. Every byte of every pool is compared, nothing excluded."""
import pytest
import torch

from dsv4_tree.attention.backend import get_backend
from dsv4_tree.sglang_plugin import install_move_kv_cache
from dsv4_tree.sglang_plugin.backend import TreeDeepseekV4AttnBackend
from plugin_probe import dsv4_dir
from sgl_cases import StandIn, sglang_tree
from sgl_graph import RunnerBuffers, captured, graph_backend, verify_batch, verify_spec
from sgl_pool import fill_random, make_pool, published_context, snapshot, swa_pack
from sgl_round import (Case, NodeInputs, commit, differing, greedy_accept, random_targets, unchanged,
                       verify_writes)
from test_sglang_graph_draft import STEPS, TOPK, draft_batch, draft_slots, multistep

N, BS = 8, 2


@pytest.fixture(scope="module")
def context(tmp_path_factory):
    with published_context(dsv4_dir(str(tmp_path_factory.mktemp("models"))), 10):
        install_move_kv_cache()
        yield


def verify_metadata(be, bufs, rpi, seq_lens, rn, rs, out_loc, graphed: bool):
    bs = rpi.shape[0]
    if not graphed:
        be.init_forward_metadata(verify_batch(bs, rpi, seq_lens, out_loc, verify_spec(rn, rs)))
        return be.forward_metadata
    be.init_cuda_graph_state(bs, bs * N)
    capture = verify_batch(bs, bufs.req_pool_indices[:bs], bufs.seq_lens[:bs], bufs.out_cache_loc[:bs * N],
                           verify_spec(None, None))
    be.init_forward_metadata_out_graph(capture, in_capture=True)
    with captured():
        be.init_forward_metadata_in_graph(capture)
    prpi, pseq = bufs.load(rpi, seq_lens, bs, out_loc)
    be.init_forward_metadata_out_graph(verify_batch(bs, prpi, pseq, out_loc, verify_spec(rn, rs)))
    with captured():
        be.init_forward_metadata_in_graph(capture)  # the replay: the captured build on the capture's inputs
    return be.forward_metadata


def draft_writes(draft_pool, req_to_token, mapping, rpi, seq_lens, records, graphed: bool):
    """The draft steps' metadata (replayed or eager) and each step's SWA write at its raw_out_loc."""
    ms = multistep(req_to_token, mapping)
    loc = draft_slots(req_to_token, rpi, seq_lens.tolist(), BS)
    if graphed:
        bufs = RunnerBuffers(BS, BS * TOPK * STEPS)
        ms.init_cuda_graph_state(BS, BS * TOPK)
        capture = draft_batch(BS, bufs.req_pool_indices, bufs.seq_lens, bufs.out_cache_loc)
        ms.init_forward_metadata_out_graph(capture, in_capture=True)
        with captured():
            ms.init_forward_metadata_in_graph(capture)
        prpi, pseq = bufs.load(rpi, seq_lens, BS, loc)
        ms.init_forward_metadata_out_graph(draft_batch(BS, prpi, pseq, bufs.out_cache_loc))
        with captured():
            ms.init_forward_metadata_in_graph(capture)
    else:
        ms.init_forward_metadata(draft_batch(BS, rpi, seq_lens, loc))
    metas = [be.forward_metadata for be in ms.attn_backends[:STEPS - 1]]
    for meta, rec in zip(metas, records):
        slots = meta.core_attn_metadata.raw_out_loc.to(torch.int64)
        draft_pool.set_swa_key_buffer(0, draft_pool.translate_loc_from_full_to_swa(slots), swa_pack(rec))
    return metas


def test_round_through_replay_equals_the_eager_round(context, no_flashmla_schedule):
    gen = torch.Generator().manual_seed(83)
    lens = [125, 381]  # C4 and C128 blocks close inside both windows
    case = Case(lens, gen, N)
    req_to_token, mapping = case.req_to_token, case.mapping
    req_to_token[0] = 0  # SGLang's padding row
    rpi, seq_lens = torch.tensor([2, 1], dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)
    _, rn, rs = sglang_tree(BS, TOPK, STEPS, N, seq_lens, gen)
    inputs = NodeInputs.draw(BS * N, case.comps, gen)
    records = [NodeInputs.draw(BS * TOPK, [], gen).swa for _ in range(STEPS - 1)]
    targets = random_targets(rn, rs, gen, True)
    out_loc = torch.cat([req_to_token[r, p:p + N] for r, p in zip(rpi.tolist(), lens)]).to(torch.int64)
    pages = req_to_token.shape[0] * (req_to_token.shape[1] // 256) + 1
    draft_pools = []
    for pool, graphed in ((case.tree_pool, False), (case.chain_pool, True)):
        draft_pool = make_pool(pages, req_to_token.shape[0], mapping, ratios=(0,))
        fill_random(draft_pool, torch.Generator().manual_seed(5))
        draft_writes(draft_pool, req_to_token, mapping, rpi, seq_lens, records, graphed)
        draft_pools.append(draft_pool)
        be = graph_backend(TreeDeepseekV4AttnBackend, StandIn(req_to_token, mapping, N), topk=TOPK, pool=pool)
        meta = verify_metadata(be, RunnerBuffers(BS, BS * N), rpi, seq_lens, rn, rs, out_loc, graphed)
        verify_writes(pool, req_to_token, mapping, rpi, seq_lens, rn, rs, inputs, case.comps, get_backend("torch"),
                      meta=meta)
        accept_index, accept_lens = greedy_accept(rn, rs, targets, STEPS)
        assert int(accept_lens.min()) >= 2  # the round accepts drafts in both requests
        commit(pool, rpi, seq_lens, rn, rs, out_loc, accept_index, accept_lens)
    eager, replayed = snapshot(case.tree_pool), snapshot(case.chain_pool)
    assert differing(eager, replayed, unchanged(eager)) == {}
    d_eager, d_replayed = snapshot(draft_pools[0]), snapshot(draft_pools[1])
    assert differing(d_eager, d_replayed, unchanged(d_eager)) == {}
