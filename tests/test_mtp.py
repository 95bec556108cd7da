"""The MTP drafter: loading mtp.* weights, EAGLE-2 trees, draft-extend, and exact greedy."""
import functools

import pytest
import torch

import dsv4_tree as dt
from cases import prompt
from dsv4_tree.drafters import MtpDrafter, TreeShape
from dsv4_tree.checkpoint.mtp import load_mtp, mtp_state_dict, to_checkpoint_names
from dsv4_tree.checkpoint.tiny import random_mtp, write_random_checkpoint
from dsv4_tree.reference.mtp import mtp_masked_rows, mtp_reference_rows
from dsv4_tree.reference.mtp_extend import ref_draft_window, sglang_extend_rows
from test_generate import hf_greedy

TOL = 1e-4  # fp32, rounding only (see design_notes/tolerances.md)


@functools.lru_cache(maxsize=None)
def mtp_model(tmp_root="/tmp/dsv4_tree_test_mtp"):
    cfg = dt.tiny_config(sliding_window=8, compress_rates={"heavily_compressed_attention": 16}, index_topk=3,
                         max_position_embeddings=512)
    return dt.load_model(write_random_checkpoint(f"{tmp_root}/with_mtp", cfg))


def committed_inputs(req):
    """MTP inputs of the committed rows: SGLang's draft-extend rows t = 0 .. P-2 (x_{t+1}, h_t),
    the root row's (x_P, h_{P-1}) left out. Needs every committed row's streams."""
    assert req.new_hidden.shape[0] == req.seq_len
    ids, hid, _ = sglang_extend_rows(req.tokens, req.root_token, req.new_hidden)
    return ids[:-1], hid[:-1]


def sliding(n: int, window: int) -> torch.Tensor:
    i = torch.arange(n)
    return (i.view(-1, 1) >= i.view(1, -1)) & (i.view(-1, 1) - i.view(1, -1) < window)


@pytest.mark.parametrize("prompt_len", [2, 4, 7, 23])
def test_chain_drafter_equals_step_by_step_sglang_draft_extend(prompt_len):
    """P = prompt_len - 1 committed positions, P < window (8) but the last: every draft step's
    logits equal the Hugging Face layer's dense run over SGLang's draft-extend rows, built row by
    row (row t: x_{t+1} with the target's streams at t, RoPE position t; none for x_0), then the
    chain's own rows (drafted token, the parent row's output streams). A row pairing x_0 with
    zero streams (visible while P < window) fails this."""
    model = mtp_model()
    eng = dt.Engine(model, dt.SpecConfig(num_steps=5))
    drafter = MtpDrafter(model, TreeShape(1, 5, 6), record=True)
    req = eng.prefill(prompt(prompt_len, 1), hidden_rows=10**6)  # keep every row's streams for the reference
    tree = drafter.draft(eng, [req])[0]
    assert tree.is_chain() and tree.num_nodes == 6
    rows = drafter.records[req.request_id].rows
    toks, hid, pos = sglang_extend_rows(req.tokens, req.root_token, req.new_hidden)
    assert toks.numel() == req.seq_len and int(toks[-1]) == req.root_token and pos.tolist() == list(range(req.seq_len))
    expected = []
    for step in range(5):
        logits, out = mtp_masked_rows(model, drafter.mtp, toks, hid, pos, sliding(len(toks), model.window))
        err = float((logits[-1] - rows.logits[step]).abs().max() / logits[-1].abs().max())
        assert err < TOL, f"P={req.seq_len} step {step}: {err:.2e}"
        nxt = int(logits[-1].argmax())
        expected.append(nxt)
        toks, hid, pos = torch.cat([toks, torch.tensor([nxt])]), torch.cat([hid, out[-1:]]), torch.cat([pos, pos[-1:] + 1])
    assert tree.tokens[1:].tolist() == expected
    # the draft layer's window: the K=V rows of SGLang's rows t = 0 .. P-2 (the last `window`)
    want, last = ref_draft_window(model, drafter.mtp, req.tokens, req.root_token, req.new_hidden)
    cache = drafter.caches[req.request_id]
    assert cache.window.shape == want.shape == (min(model.window, req.seq_len - 1), model.config.head_dim)
    torch.testing.assert_close(cache.window, want, rtol=0, atol=1e-4 * float(want.abs().max()) if want.numel() else 0)
    assert torch.equal(cache.prev_hidden, last)


def test_one_token_prompt_drafts_its_root_alone_then_the_sglang_row():
    """P = 0 (a one-token prompt): no target streams yet, so no draft (SGLang drafts after a target
    pass); in a batch with others, those are drafted as alone. After one round, P = 1: the
    root row is SGLang's (x_1, h_0) and the window is empty."""
    model = mtp_model()
    eng = dt.Engine(model, dt.SpecConfig(num_steps=3))
    drafter = MtpDrafter(model, TreeShape(1, 3, 4), record=True)
    one, other = eng.prefill(prompt(1, 3)), eng.prefill(prompt(6, 4))
    with pytest.raises(dt.StateError, match="nothing committed"):
        drafter.expand([one])
    trees = drafter.draft(eng, [one, other])
    assert trees[0].num_nodes == 1 and int(trees[0].tokens[0]) == one.root_token
    alone = MtpDrafter(model, TreeShape(1, 3, 4), mtp=drafter.mtp).draft(eng, [eng.prefill(prompt(6, 4))])[0]
    assert torch.equal(trees[1].tokens, alone.tokens)
    out = eng.verify([one, other], trees)
    eng.commit([one, other], eng.accept_greedy([one, other], trees, out), out)
    assert one.seq_len == 1
    tree = drafter.draft(eng, [one])[0]
    assert tree.num_nodes == 4 and drafter.caches[one.request_id].window.shape[0] == 0
    toks, hid, pos = sglang_extend_rows(one.tokens, one.root_token, one.new_hidden)
    logits, _ = mtp_masked_rows(model, drafter.mtp, toks, hid, pos, sliding(1, model.window))
    got = drafter.records[one.request_id].rows.logits[0]
    assert float((logits[-1] - got).abs().max() / logits[-1].abs().max()) < TOL


@pytest.mark.parametrize("topk,steps,nodes", [(2, 4, 8), (4, 3, 16), (3, 5, 12)])
def test_draft_tree_shape_and_per_path_mtp_rows(topk, steps, nodes):
    model = mtp_model()
    eng = dt.Engine(model, dt.SpecConfig(eagle_topk=topk, num_steps=steps, num_draft_tokens=nodes))
    drafter = MtpDrafter(model, TreeShape(topk, steps, nodes), record=True)
    other = eng.prefill(prompt(9, 40 + topk))  # drafted in the same batch: rows must not mix
    req = eng.prefill(prompt(3 + 2 * topk, topk), hidden_rows=10**6)  # P = 6, 10, 8 against the window 8
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
    a = drafter.sync([req])[0]
    fresh = eng.prefill(torch.cat([req.tokens, torch.tensor([req.root_token])]), hidden_rows=10**6)
    fresh_drafter = MtpDrafter(model, TreeShape(2, 3, 6), mtp=drafter.mtp)
    b = fresh_drafter.sync([fresh])[0]
    assert a.seq_len == b.seq_len == req.seq_len
    assert torch.allclose(a.prev_hidden, b.prev_hidden, atol=1e-4)
    assert torch.allclose(a.window, b.window, atol=1e-4)
    want, last = ref_draft_window(model, drafter.mtp, fresh.tokens, fresh.root_token, fresh.new_hidden)
    assert torch.allclose(a.window, want, atol=1e-4) and torch.allclose(a.prev_hidden, last, atol=1e-4)


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
        folded.sync(reqs[2:])  # request 2 has no pending rows at the draft
        passes.clear()
        with monkeypatch.context() as m:
            m.setattr(rows_module, "kv_rows", counted)
            trees = folded.draft(eng, reqs)
        assert len(passes) == 3, f"{rnd=}: {len(passes)} draft-layer passes for 3 steps (a separate extend adds one)"
        for cache, want in zip([folded.caches[r.request_id] for r in reqs], separate.sync(reqs)):
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


@pytest.mark.parametrize("prompt_len", [9, 40])
def test_shipped_mtp_drafts_sglangs_rows_below_the_window(prompt_len):
    """The shipped trained checkpoint (window 64), P < window: the MTP chain's every step equals the
    Hugging Face layer's run over SGLang's draft-extend rows (relative 1e-4, fp32)."""
    from dsv4_tree.train.corpus import heldout_prompt

    model = dt.load_model(dt.trained_checkpoint())
    eng = dt.Engine(model, dt.SpecConfig(num_steps=4))
    drafter = MtpDrafter(model, TreeShape(1, 4, 5), record=True)
    req = eng.prefill(torch.tensor(heldout_prompt(prompt_len, 2)), hidden_rows=10**6)
    assert req.seq_len < model.window
    tree = drafter.draft(eng, [req])[0]
    rows = drafter.records[req.request_id].rows
    toks, hid, pos = sglang_extend_rows(req.tokens, req.root_token, req.new_hidden)
    for step in range(4):
        logits, out = mtp_masked_rows(model, drafter.mtp, toks, hid, pos, sliding(len(toks), model.window))
        err = float((logits[-1] - rows.logits[step]).abs().max() / logits[-1].abs().max())
        assert err < TOL, f"P={req.seq_len} step {step}: {err:.2e}"
        toks = torch.cat([toks, tree.tokens[step + 1 : step + 2]])
        hid, pos = torch.cat([hid, out[-1:]]), torch.cat([pos, pos[-1:] + 1])
