"""An MTP draft's steps after its root at a fixed shape, captured per batch bucket
(drafters/mtp_wave.py, MtpDrafter(graphs=...)).

* padded_window_index lists, for every frontier row, exactly the window keys window_index lists
  over the packed windows;
* the captured function (fixed_wave) reads nothing from the host on the round's real inputs
  (forbid_host_sync, HostReadCounter) and runs on the meta device;
* a captured drafter replays its bucket's wave every round of generate_batch; each round's
  expansion equals the eager one on the same requests (scores within fp32 rounding: the padded
  windows' wider key lists only change the reductions' blocking) and the output stays Hugging
  Face's greedy one.

On CPU the capture is executor/graphs.py's eager stand-in; on a CUDA device (DSV4_TREE_GPU=1,
scripts/gpu_check) a real CUDA graph."""
from __future__ import annotations

import pytest
import torch

import dsv4_tree as dt
from dsv4_tree.diagnostics import HostReadCounter, forbid_host_sync
from dsv4_tree.drafters.base import TreeShape
from dsv4_tree.drafters.mtp import MtpDrafter
from dsv4_tree.drafters.mtp_cache import window_index
from dsv4_tree.drafters.mtp_wave import fixed_wave, padded_window_index
from dsv4_tree.errors import ConfigError
from dsv4_tree.executor.graphs import cuda_capture, eager_capture
from dsv4_tree.train.corpus import heldout_prompt
from test_dspark_graphs import rehearse_on_meta

SHAPE = TreeShape(4, 5, 8)
REL_TOL = 1e-5  # fp32, the same keys in a wider, padded list: a few ulps through one layer and a softmax


@pytest.fixture(scope="module")
def trained():
    return dt.load_model(dt.trained_checkpoint())


def _engine(model, shape=SHAPE, depth="fixed", **spec):
    return dt.Engine(model, dt.SpecConfig(eagle_topk=shape.topk, num_steps=shape.num_steps,
                                          num_draft_tokens=shape.num_draft_tokens, draft_depth=depth,
                                          max_requests=8, **spec))


def test_padded_window_index_lists_the_packed_keys():
    w, k = 16, 3
    lengths = [0, 5, 16, 11]
    offsets = [sum(lengths[:b]) for b in range(len(lengths))]
    for depth in (1, 4, 15, 17):
        packed = window_index(torch.tensor(lengths), depth, k, w)
        padded = padded_window_index(torch.tensor(lengths), depth, k, w)
        assert tuple(padded.shape) == (len(lengths) * k, w)
        for r in range(padded.shape[0]):
            b = r // k
            got = sorted(offsets[b] + (x - b * w) for x in padded[r].tolist() if x >= 0)
            assert all(b * w <= x < b * w + lengths[b] for x in padded[r].tolist() if x >= 0)
            assert got == sorted(x for x in packed[r].tolist() if x >= 0), f"depth {depth} row {r}"


def test_the_captured_wave_reads_nothing_and_runs_on_meta(trained):
    model = dt.load_model(dt.trained_checkpoint())  # its own: moved to the meta device below
    model.hf.set_experts_implementation("batched_mm")  # the meta device's grouped GEMM takes bf16 only

    def guarded(fn):  # capture = run under the guards, then the eager stand-in
        with torch.inference_mode(), forbid_host_sync(), HostReadCounter() as reads:
            fn()
        assert reads.total == 0, dict(reads.by_reason)
        guarded.calls += 1
        return eager_capture(fn)

    guarded.calls = 0
    drafter = MtpDrafter(model, SHAPE, graphs=guarded)
    seen, real = [], drafter.graphs.fn
    drafter.graphs.fn = lambda key, *inputs: seen.append(inputs) or real(key, *inputs)
    _engine(model).generate_batch([heldout_prompt(48, s) for s in range(3)], 6, drafter=drafter, progress=False)
    assert guarded.calls >= 1 and seen
    inputs = seen[-1]
    want = fixed_wave(model, drafter.mtp, SHAPE, *inputs)[0]
    model.hf.to("meta")
    drafter.mtp.to("meta")
    meta = rehearse_on_meta(lambda *a: fixed_wave(model, drafter.mtp, SHAPE, *a), *inputs)[0]
    assert meta.tokens.device.type == "meta" and meta.tokens.shape == want.tokens.shape


def test_a_captured_mtp_drafter_drafts_as_the_eager_one_and_generates_hugging_faces_output(trained, device):
    model = trained if device.type == "cpu" else dt.load_model(dt.trained_checkpoint(), device=device)
    drafter = MtpDrafter(model, SHAPE, graphs=device.type == "cuda" or eager_capture)
    keys, real_run = [], drafter.graphs.run
    drafter.graphs.run = lambda *a, **k: keys.append(k["key"]) or real_run(*a, **k)
    real_expand, compared = drafter.expand, []

    def expand(requests, depth=None, graphed=False):
        got = real_expand(requests, depth, graphed)
        assert graphed, "generate_batch's batches are graphed ones"
        want = real_expand(requests, depth, False)  # eager, same state (step 0's rows are in the caches now)
        for d, (a, b) in enumerate(zip(got.score_list, want.score_list)):
            err = float((a - b).abs().max())
            assert err <= REL_TOL, f"round {len(compared)} depth {d}: scores differ by {err:.2e}"
        assert [t.host_lists()[0][0] for t in got.trees] == [r.root_token for r in requests]
        compared.append(len(requests))
        return got

    drafter.expand = expand
    prompts = [heldout_prompt(64, 40 + s) for s in range(3)]
    outs = _engine(model).generate_batch(prompts, 16, drafter=drafter, progress=False)
    rounds = max(o.stats.rounds for o in outs)
    assert len(compared) == len(keys) == rounds and set(keys) == {("fixed",)}
    assert (4, "fixed") in drafter.graphs.graphs and {k[0] for k in drafter.graphs.graphs} <= {1, 2, 4}
    assert any(a > 1 for o in outs for a in o.stats.accept_lengths)
    hf = dt.load_model(dt.trained_checkpoint()).hf
    for p, o in zip(prompts, outs):
        assert o.tokens == hf.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False)[0, len(p):].tolist()


def test_mtp_graphs_are_refused_by_name_and_serve_fixed_depth_only(trained):
    with pytest.raises(ConfigError, match="MtpDrafter graphs=True captures drafts in CUDA graphs; the model is on cpu"):
        MtpDrafter(trained, SHAPE, graphs=True)
    with pytest.raises(ConfigError, match="MtpDrafter graphs must be True, False or a capture function, got 1"):
        MtpDrafter(trained, SHAPE, graphs=1)
    # adaptive depth (host decisions between steps) and recorded drafts run eagerly
    for depth, record in (("adaptive", False), ("fixed", True)):
        drafter = MtpDrafter(trained, SHAPE, graphs=eager_capture, record=record)
        _engine(trained, depth=depth).generate_batch([heldout_prompt(48, 3)], 6, drafter=drafter, progress=False)
        assert not drafter.graphs.graphs, (depth, record)
    # past the engine's graphed batches (cuda_graph_max_bs) too
    drafter = MtpDrafter(trained, SHAPE, graphs=eager_capture)
    _engine(trained, cuda_graph_max_bs=1).generate_batch([heldout_prompt(48, s) for s in range(2)], 6,
                                                          drafter=drafter, progress=False)
    assert {k[0] for k in drafter.graphs.graphs} <= {1}
