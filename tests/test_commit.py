"""Commit: the committed cache after accepting a path equals serial decode of those tokens."""
import pytest
import torch
from transformers import DynamicCache

import dsv4_tree as dt
from cases import REL_TOL, deep_chain_tree, engine_for, prompt, random_tree, small_model
from dsv4_tree.reference import per_path_logits, relative_error
from dsv4_tree.verify.commit import layer_summary

# commit copies verify's rows; serial decode recomputes them in batches of one row, so the
# two differ by GEMM rounding only (~1e-6). A wrong row or entry differs by O(1).
STATE_TOL = 1e-5


def serial_decode(eng, p, tokens):
    """Feed `tokens` one decode step each (1-node trees), starting after prefill(p)."""
    req = eng.prefill(p)
    seq = [req.root_token] + list(tokens)
    for i in range(len(tokens)):
        tree = dt.DraftTree.chain([seq[i]])
        out = eng.verify([req], [tree])
        eng.commit([req], [dt.Acceptance((0,), seq[i + 1], req.request_id, out.verify_id)], out)
    return req


def assert_same_state(a, b, label):
    assert a.seq_len == b.seq_len and a.root_token == b.root_token, label
    assert torch.equal(a.tokens, b.tokens), label
    for li, (la, lb) in enumerate(zip(a.cache.layers, b.cache.layers)):
        sa, sb = layer_summary(la), layer_summary(lb)
        assert sa.keys() == sb.keys(), f"{label} layer {li}: {sorted(sa)} vs {sorted(sb)}"
        for k in sa:
            assert sa[k].shape == sb[k].shape, f"{label} layer {li} {k}: {sa[k].shape} vs {sb[k].shape}"
            if sa[k].numel():
                err = float((sa[k].double() - sb[k].double()).abs().max())
                assert err < STATE_TOL, f"{label} layer {li} {k}: max diff {err:.2e}"


@pytest.mark.parametrize("P,k", [(5, 0), (9, 3), (13, 7), (14, 12), (30, 5)])
def test_chain_commit_equals_serial_decode(P, k):
    model = small_model()
    eng = engine_for(model, topk=1, steps=12, nodes=13)
    p = prompt(P + 1, seed=P)
    tree = deep_chain_tree(int(p[-1]), 12, seed=k)
    req = eng.prefill(p)
    out = eng.verify([req], [tree])
    bonus = int(tree.tokens[k + 1]) if k + 1 < tree.num_nodes else 3
    eng.commit([req], [dt.Acceptance(tuple(range(k + 1)), bonus, req.request_id, out.verify_id)], out)
    ref = serial_decode(eng, p, tree.tokens[1 : k + 1].tolist() + [bonus])
    assert_same_state(req, ref, f"{P=} {k=}")
    # and the next verify still matches the oracle
    nxt = deep_chain_tree(req.root_token, 6, seed=99)
    got = eng.verify([req], [nxt]).logits[0]
    want = per_path_logits(model, req.tokens, nxt)
    assert relative_error(got, want) < REL_TOL


def test_tree_commit_equals_serial_decode_and_copies_rows_bitwise():
    model = small_model()
    eng = engine_for(model)
    p = prompt(14, 21)
    tree = random_tree(int(p[-1]), 40, 10, 3, 22)
    leaf = int(tree.leaves[torch.argmax(tree.depth[tree.leaves])])
    path = tree.path[leaf][tree.path[leaf] >= 0]
    req = eng.prefill(p)
    out = eng.verify([req], [tree])
    eng.commit([req], [dt.Acceptance(tuple(path.tolist()), 5, req.request_id, out.verify_id)], out)
    ref = serial_decode(eng, p, tree.tokens[path[1:]].tolist() + [5])
    assert_same_state(req, ref, f"tree path {path.tolist()}")
    # data movement is exact: committed window rows are verify's rows of the accepted nodes
    for li, lc in enumerate(req.cache.layers):
        raw = out.run.layers[li].raw[path]
        n = min(raw.shape[0], lc.window.shape[0])
        assert torch.equal(lc.window[-n:], raw[-n:]), f"layer {li}"
        if lc.main is not None:
            cp = out.plan.requests[0].compress[lc.main.ratio]
            owned = cp.entry_of_node[path]
            owned = owned[owned >= 0]
            new = lc.main.entries.rows[-owned.numel():] if owned.numel() else lc.main.entries.rows[:0]
            assert torch.equal(new, out.run.layers[li].main.entries[0][owned]), f"layer {li} entries"


def test_rejected_siblings_leave_no_trace():
    """Two trees share the accepted path but differ everywhere else: same committed state."""
    model = small_model()
    eng = engine_for(model)
    p = prompt(22, 31)
    base = random_tree(int(p[-1]), 30, 8, 3, 32)
    leaf = int(base.leaves[torch.argmax(base.depth[base.leaves])])
    path = base.path[leaf][base.path[leaf] >= 0]
    other = base.tokens.clone()
    off = torch.ones(base.num_nodes, dtype=torch.bool)
    off[path] = False
    other[off] = (other[off] + 123) % 500 + 2
    states = []
    for toks in (base.tokens, other):
        tree = dt.DraftTree(toks, base.parents)
        req = eng.prefill(p)
        out = eng.verify([req], [tree])
        eng.commit([req], [dt.Acceptance(tuple(path.tolist()), 9, req.request_id, out.verify_id)], out)
        states.append(req)
    assert_same_state(states[0], states[1], "sibling tokens changed")


def test_commit_matches_hugging_face_dynamic_cache():
    """Our committed state equals HF's own cache fields after serial HF decoding."""
    model = small_model()
    eng = engine_for(model, topk=1, steps=12, nodes=13)
    p = prompt(18, 41)
    tree = deep_chain_tree(int(p[-1]), 12, seed=42)
    req = eng.prefill(p)
    out = eng.verify([req], [tree])
    eng.commit([req], [dt.Acceptance(tuple(range(10)), 7, req.request_id, out.verify_id)], out)
    full = torch.cat([p, tree.tokens[1:10]])
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        for i in range(full.numel()):
            model.hf(input_ids=full[i : i + 1].unsqueeze(0), past_key_values=cache, use_cache=True)
    for li, hl in enumerate(cache.layers):
        ours = req.cache.layers[li]
        keys = hl.keys[0, 0]
        assert torch.allclose(ours.window[-keys.shape[0]:], keys, atol=STATE_TOL), f"layer {li} window"
        for name, st in (("compressor", ours.main), ("indexer", ours.indexer)):
            if st is None:
                continue
            assert hl.entry_count[name] == st.entry_count, f"layer {li} {name} entry_count"
            assert torch.allclose(hl.compressed_kv[name][0], st.entries.rows, atol=STATE_TOL)
            assert torch.allclose(hl.buffer_kv[name][0], st.buffer_kv, atol=STATE_TOL)
            assert torch.allclose(hl.buffer_gate[name][0], st.buffer_gate, atol=STATE_TOL)
            if st.overlap:
                assert torch.allclose(hl.overlap_kv[name][0], st.overlap_kv, atol=STATE_TOL)
                assert torch.allclose(hl.overlap_gate[name][0], st.overlap_gate, atol=STATE_TOL)


def test_prefill_in_chunks_equals_one_chunk():
    """Chunk boundaries (here every 7 tokens) leave the same state as one long prefill."""
    model = small_model()
    p = prompt(40, 77)
    whole = dt.Engine(model, dt.SpecConfig(prefill_chunk=256)).prefill(p)
    chunked_eng = dt.Engine(model, dt.SpecConfig(prefill_chunk=7, num_steps=6))
    chunked = chunked_eng.prefill(p)
    assert_same_state(whole, chunked, "chunked prefill")
    nxt = deep_chain_tree(chunked.root_token, 6, seed=1)
    got = chunked_eng.verify([chunked], [nxt]).logits[0]
    assert relative_error(got, per_path_logits(model, chunked.tokens, nxt)) < REL_TOL
