"""The MTP drafter: loading mtp.* weights, EAGLE-2 trees, draft-extend, and exact greedy."""
import functools

import pytest
import torch

import dsv4_tree as dt
from cases import prompt
from dsv4_tree.drafters import MtpDrafter, TreeShape
from dsv4_tree.checkpoint.mtp import load_mtp, mtp_state_dict, to_checkpoint_names
from dsv4_tree.checkpoint.tiny import random_mtp, write_random_checkpoint
from dsv4_tree.reference.mtp import mtp_reference_rows
from dsv4_tree.reference.mtp_extend import ref_draft_extend
from test_generate import hf_greedy

TOL = 1e-4  # fp32, rounding only (see design_notes/tolerances.md)


@functools.lru_cache(maxsize=None)
def mtp_model(tmp_root="/tmp/dsv4_tree_test_mtp"):
    cfg = dt.tiny_config(sliding_window=8, compress_rates={"heavily_compressed_attention": 16}, index_topk=3,
                         max_position_embeddings=512)
    return dt.load_model(write_random_checkpoint(f"{tmp_root}/with_mtp", cfg))


def committed_inputs(req):
    """MTP inputs of the committed rows: tokens x_0..x_{P-1}, streams [0, h_0 .. h_{P-2}]."""
    h = req.new_hidden
    return req.tokens, torch.cat([torch.zeros(1, *h.shape[1:]), h[:-1]])


def test_chain_drafter_equals_step_by_step_mtp():
    model = mtp_model()
    eng = dt.Engine(model, dt.SpecConfig(num_steps=5))
    drafter = MtpDrafter(model, TreeShape(1, 5, 6))
    req = eng.prefill(prompt(23, 1), hidden_rows=10**6)  # keep every row's streams for the reference
    tree = drafter.draft(eng, [req])[0]
    assert tree.is_chain() and tree.num_nodes == 6
    toks, hid = committed_inputs(req)
    toks = torch.cat([toks, torch.tensor([req.root_token])])
    hid = torch.cat([hid, req.new_hidden[-1:]])
    expected = []
    for _ in range(5):
        logits, out = mtp_reference_rows(model, drafter.mtp, toks, hid)
        nxt = int(logits[-1].argmax())
        expected.append(nxt)
        toks = torch.cat([toks, torch.tensor([nxt])])
        hid = torch.cat([hid, out[-1:]])
    assert tree.tokens[1:].tolist() == expected


@pytest.mark.parametrize("topk,steps,nodes", [(2, 4, 8), (4, 3, 16), (3, 5, 12)])
def test_draft_tree_shape_and_per_path_mtp_rows(topk, steps, nodes):
    model = mtp_model()
    eng = dt.Engine(model, dt.SpecConfig(eagle_topk=topk, num_steps=steps, num_draft_tokens=nodes))
    drafter = MtpDrafter(model, TreeShape(topk, steps, nodes), record=True)
    other = eng.prefill(prompt(9, 40 + topk))  # drafted in the same batch: rows must not mix
    req = eng.prefill(prompt(17 + topk, topk), hidden_rows=10**6)
    tree = drafter.draft(eng, [other, req])[1]
    assert tree.num_nodes == nodes and tree.max_depth <= steps and int(tree.tokens[0]) == req.root_token
    assert max(len(tree.children(i)) for i in range(nodes)) <= topk
    # every MTP row of the expansion equals a standalone run of committed rows ++ its path
    st, record = drafter.caches[req.request_id], drafter.records[req.request_id]
    rows, dtree = record.rows, record.tree
    toks0, hid0 = committed_inputs(req)
    for i in range(dtree.num_nodes):
        path = dtree.path[i][dtree.path[i] >= 0]
        hin = [st.prev_hidden] + [rows.hidden[int(dtree.parents[j])] for j in path[1:]]
        logits, out = mtp_reference_rows(model, drafter.mtp, torch.cat([toks0, dtree.tokens[path]]),
                                         torch.cat([hid0, torch.stack(hin)]))
        err = float((logits[-1] - rows.logits[i]).abs().max() / logits[-1].abs().max())
        assert err < TOL, f"{topk=} {steps=} node {i}: {err:.2e}"
        assert torch.allclose(out[-1], rows.hidden[i], atol=1e-4)


@pytest.mark.parametrize("topk,steps,nodes", [(1, 4, 5), (4, 4, 16)])
def test_greedy_with_mtp_equals_hf_greedy(topk, steps, nodes):
    model = mtp_model()
    ids = prompt(12, 5).repeat(2)
    want = hf_greedy(model, ids, 40)
    eng = dt.Engine(model, dt.SpecConfig(eagle_topk=topk, num_steps=steps, num_draft_tokens=nodes))
    drafter = MtpDrafter(model, TreeShape(topk, steps, nodes))
    res = eng.generate(ids, 40, drafter=drafter, progress=False)
    assert res.tokens == want


def test_draft_extend_tracks_commits():
    """After rounds of verify/commit, the draft layer's state equals one built from scratch."""
    model = mtp_model()
    eng = dt.Engine(model, dt.SpecConfig(eagle_topk=2, num_steps=3, num_draft_tokens=6))
    drafter = MtpDrafter(model, TreeShape(2, 3, 6))
    req = eng.prefill(prompt(15, 9))
    for _ in range(4):
        tree = drafter.draft(eng, [req])[0]
        out = eng.verify([req], [tree])
        # accept the deepest path so several rows are committed each round
        leaf = int(tree.leaves[torch.argmax(tree.depth[tree.leaves])])
        path = tree.path[leaf][tree.path[leaf] >= 0]
        eng.commit([req], [dt.Acceptance(tuple(path.tolist()), 7, req.request_id, out.verify_id)], out)
    ref_draft_extend(drafter, [req])
    fresh = eng.prefill(torch.cat([req.tokens, torch.tensor([req.root_token])]))
    fresh_drafter = MtpDrafter(model, TreeShape(2, 3, 6), mtp=drafter.mtp)
    ref_draft_extend(fresh_drafter, [fresh])
    a, b = drafter.caches[req.request_id], fresh_drafter.caches[fresh.request_id]
    assert a.seq_len == b.seq_len == req.seq_len
    assert torch.allclose(a.prev_hidden, b.prev_hidden, atol=1e-4)
    assert torch.allclose(a.window, b.window, atol=1e-4)


def test_draft_folds_the_extend_into_step_0(monkeypatch):
    """A draft runs the rows committed since the last draft in its step-0 pass (no separate
    extend pass) and leaves the caches a separate extend would: three requests, one past the
    window (8), one inside it, one already extended (no pending rows), over rounds that commit
    different path lengths."""
    import dsv4_tree.drafters.window_layer as rows_module

    model = mtp_model()
    eng = dt.Engine(model, dt.SpecConfig(eagle_topk=2, num_steps=3, num_draft_tokens=6))
    folded = MtpDrafter(model, TreeShape(2, 3, 6))
    separate = MtpDrafter(model, TreeShape(2, 3, 6), mtp=folded.mtp)
    reqs = [eng.prefill(prompt(15, 4)), eng.prefill(prompt(5, 5)), eng.prefill(prompt(11, 6))]

    passes = []

    def counted(*args):
        passes.append(1)
        return real(*args)

    real = rows_module.kv_rows

    for rnd in range(4):
        ref_draft_extend(folded, reqs[2:])  # request 2 has no pending rows at the draft
        passes.clear()
        with monkeypatch.context() as m:
            m.setattr(rows_module, "kv_rows", counted)
            trees = folded.draft(eng, reqs)
        assert len(passes) == 3, f"{rnd=}: {len(passes)} draft-layer passes for 3 steps (a separate extend adds one)"
        for cache, want in zip([folded.caches[r.request_id] for r in reqs], ref_draft_extend(separate, reqs)):
            assert cache.seq_len == want.seq_len
            assert cache.window.shape == want.window.shape
            # GEMMs over another set of rows (pending + roots against pending alone) round differently
            torch.testing.assert_close(cache.window, want.window, rtol=0, atol=1e-5)
            assert torch.equal(cache.prev_hidden, want.prev_hidden)
        out = eng.verify(reqs, trees)
        accs = eng.accept_greedy(reqs, trees, out)
        # round 0 keeps the greedy paths; later rounds commit the deepest path of request 0
        if rnd:
            leaf = int(trees[0].leaves[torch.argmax(trees[0].depth[trees[0].leaves])])
            path = trees[0].path[leaf][trees[0].path[leaf] >= 0]
            accs[0] = dt.Acceptance(tuple(path.tolist()), 7, reqs[0].request_id, out.verify_id)
        eng.commit(reqs, accs, out)


def test_checkpoint_without_mtp_is_a_clear_error(tmp_path):
    cfg = dt.tiny_config(max_position_embeddings=512)
    model = dt.load_model(write_random_checkpoint(tmp_path / "no_mtp", cfg, with_mtp=False))
    with pytest.raises(dt.CheckpointError, match=r"no MTP weights: no tensor named mtp\.0\.\*"):
        load_mtp(model)
    with pytest.raises(dt.CheckpointError, match="not loaded from a checkpoint directory"):
        load_mtp(dt.load_model(model.hf))


def test_mtp_naming_round_trip_and_tiny_has_mtp():
    cfg = dt.tiny_config()
    block = random_mtp(cfg, 3)
    names = to_checkpoint_names(block)
    assert "mtp.0.e_proj.weight" in names and "mtp.0.ffn.experts.0.w1.weight" in names
    assert "mtp.0.attn.attn_sink" in names and "mtp.0.hc_head_fn" in names
    back = mtp_state_dict(names, cfg)
    own = block.state_dict()
    for k, v in back.items():
        assert torch.equal(own[k], v), k
    tiny = dt.load_model(dt.tiny_checkpoint())
    assert isinstance(load_mtp(tiny), torch.nn.Module)
