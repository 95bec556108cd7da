"""Commit: the committed cache after accepting a path equals serial decode of those tokens."""
import pytest
import torch
from transformers import DynamicCache

import dsv4_tree as dt
from cases import REL_TOL, deep_chain_tree, engine_for, prompt, random_tree, small_model
from dsv4_tree.reference import per_path_logits, relative_error
from cases import snapshot

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


def assert_same_state(eng, a, b, label, eng_b=None):
    assert a.seq_len == b.seq_len and a.root_token == b.root_token, label
    assert torch.equal(a.tokens, b.tokens), label
    for li, (sa, sb) in enumerate(zip(snapshot(eng, a), snapshot(eng_b or eng, b))):
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
    assert_same_state(eng, req, ref, f"{P=} {k=}")
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
    slots = out.plan.out_loc[path]
    verified = [lp.swa.record_bytes(slots).clone() for lp in eng.runtime.pools]
    entries = verified_entries(eng.runtime, req, path)
    eng.commit([req], [dt.Acceptance(tuple(path.tolist()), 5, req.request_id, out.verify_id)], out)
    ref = serial_decode(eng, p, tree.tokens[path[1:]].tolist() + [5])
    assert_same_state(eng, req, ref, f"tree path {path.tolist()}")
    assert any(name == "main" for _, name in entries), "the path must close a block"
    # data movement is exact: every committed raw row and entry of the accepted path holds the
    # bytes verify stored for that node (commit copies records, it never recomputes them)
    rt = eng.runtime
    for li, lp in enumerate(rt.pools):
        assert torch.equal(committed_rows(rt, req, tree.num_nodes, path, lp), verified[li]), f"layer {li} rows"
    for (li, name), (blocks, before) in entries.items():
        lp = rt.pools[li]
        comp = getattr(lp, name)
        first = rt.pages.token_slots(torch.full_like(blocks, req.row), blocks * comp.ratio)
        after = comp.entries.record_bytes(rt.layout.entry_slot(comp.ratio, first))
        assert before.shape[0] > 0 and torch.equal(after, before), f"layer {li} {name} entries"


def verified_entries(rt, req, path):
    """(layer, compressor) -> (block ids, stored bytes) of the branch entries the path closes."""
    out = {}
    pos = req.seq_len + torch.arange(path.numel())
    for li, lp in enumerate(rt.pools):
        for name in ("main", "indexer"):
            comp = getattr(lp, name)
            if comp is None:
                continue
            closes = (pos + 1) % comp.ratio == 0
            if closes.any():
                scratch = rt.layout.scratch_slot(comp.ratio, torch.full_like(path[closes], req.row), path[closes])
                out[(li, name)] = ((pos[closes] + 1) // comp.ratio - 1, comp.entries.record_bytes(scratch).clone())
    return out


def committed_rows(rt, req, n, path, lp):
    """Stored records of the last path.numel() committed positions of req."""
    pos = torch.arange(req.seq_len - path.numel(), req.seq_len)
    slots = rt.pages.recent_slots(rt.pages.token_slots(torch.full_like(pos, req.row), pos))
    return lp.swa.record_bytes(slots)


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
    assert_same_state(eng, states[0], states[1], "sibling tokens changed")


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
    names = {"compressor": "main", "indexer": "indexer"}
    for li, (hl, ours) in enumerate(zip(cache.layers, snapshot(eng, req))):
        keys = hl.keys[0, 0]
        assert torch.allclose(ours["window"][-keys.shape[0]:], keys, atol=STATE_TOL), f"layer {li} window"
        for name, mine in names.items():
            if f"{mine}.entries" not in ours:
                continue
            assert hl.entry_count[name] == int(ours[f"{mine}.entry_count"]), f"layer {li} {name} entry_count"
            for field in ("compressed_kv", "buffer_kv", "buffer_gate", "overlap_kv", "overlap_gate"):
                key = f"{mine}.{'entries' if field == 'compressed_kv' else field}"
                if field.startswith("overlap") and key not in ours:
                    assert name == "compressor" and model.config.layer_types[li] != "compressed_sparse_attention"
                    continue
                theirs = getattr(hl, field)[name][0]
                assert torch.allclose(theirs, ours[key], atol=STATE_TOL), f"layer {li} {name} {field}"


def test_prefill_in_chunks_equals_one_chunk():
    """Chunk boundaries (here every 7 tokens) leave the same state as one long prefill."""
    model = small_model()
    p = prompt(40, 77)
    whole_eng = dt.Engine(model, dt.SpecConfig(prefill_chunk=256))
    whole = whole_eng.prefill(p)
    chunked_eng = dt.Engine(model, dt.SpecConfig(prefill_chunk=7, num_steps=6))
    chunked = chunked_eng.prefill(p)
    assert_same_state(whole_eng, whole, chunked, "chunked prefill", chunked_eng)
    nxt = deep_chain_tree(chunked.root_token, 6, seed=1)
    got = chunked_eng.verify([chunked], [nxt]).logits[0]
    assert relative_error(got, per_path_logits(model, chunked.tokens, nxt)) < REL_TOL
