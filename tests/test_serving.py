"""The paged serving layout: page tables, pool sizing, release, buckets, commit by moves."""
import pytest
import torch

import dsv4_tree as dt
from cases import REL_TOL, check_against_oracle, engine_for, prompt, random_tree, small_model
from dsv4_tree.serving import PoolExhausted
from dsv4_tree.serving.commit import plan_moves

GPU = torch.cuda.is_available()


def test_block_longer_than_a_page_matches_per_path():
    """C128 blocks span 8 pages of 16 slots: entries are addressed one per page."""
    model = dt.load_model(dt.tiny_checkpoint())
    eng = engine_for(model, page_size=16, nodes=24, steps=8)
    p = prompt(300, 7)
    tree = random_tree(int(p[-1]), 24, 8, 3, 6)
    check_against_oracle(model, eng, [p], [tree], "page 16, ratio 128")


def test_plan_to_its_own_device_is_the_plan_and_to_another_moves_every_table():
    model = dt.load_model(dt.tiny_checkpoint())
    eng = engine_for(model, nodes=8, steps=3)
    req = eng.prefill(prompt(140, 2))
    plan = eng.plan([req], [random_tree(req.root_token, 8, 3, 2, 1)])
    assert plan.to("cpu") is plan and plan.to(torch.device("cpu")) is plan  # nothing to move
    moved = plan.to("meta")
    tensors = [moved.positions, moved.swa_index] + [t for ct in moved.compress.values() for t in (ct.entries, ct.src)]
    assert all(t.device.type == "meta" for t in tensors)
    assert plan.positions.device.type == "cpu"  # the original is untouched


def test_release_returns_every_page_and_row():
    model = small_model()
    eng = engine_for(model, page_size=16)
    before = eng.runtime.live_slots()
    reqs = [eng.prefill(prompt(20 + 9 * i, i)) for i in range(3)]
    trees = [random_tree(r.root_token, 12, 5, 3, i) for i, r in enumerate(reqs)]
    out = eng.verify(reqs, trees)
    eng.commit(reqs, eng.accept_greedy(reqs, trees, out), out)
    assert eng.runtime.live_slots() != before
    for r in reqs:
        eng.release(r)
    assert eng.runtime.live_slots() == before
    with pytest.raises(dt.StateError, match="released"):
        eng.verify([reqs[0]], [random_tree(reqs[0].root_token, 4, 2, 2, 0)])


def test_dropped_request_returns_its_pages():
    model = small_model()
    eng = engine_for(model, page_size=16)
    before = eng.runtime.live_slots()
    req = eng.prefill(prompt(40, 1))
    assert eng.runtime.live_slots() != before
    del req
    assert eng.runtime.live_slots() == before


def test_pool_exhaustion_names_the_pool_and_leaks_nothing():
    model = small_model()
    eng = engine_for(model, page_size=16, max_requests=2, max_total_tokens=64)
    a = eng.prefill(prompt(30, 2))
    state = [{k: v.clone() for k, v in layer.items()} for layer in eng.state_summary(a)]
    used = eng.runtime.live_slots()
    with pytest.raises(PoolExhausted, match=r"token pool exhausted.*of \d+ free"):
        eng.prefill(prompt(200, 3))
    assert eng.runtime.live_slots() == used
    b = eng.prefill(prompt(5, 4))
    with pytest.raises(dt.StateError, match="max_requests"):
        eng.prefill(prompt(5, 5))
    eng.release(b)
    for layer, now in zip(state, eng.state_summary(a)):
        for k in layer:
            assert torch.equal(layer[k], now[k]), k


def test_unknown_kv_cache_dtype_is_a_config_error():
    with pytest.raises(dt.ConfigError, match="kv_cache_dtype='fp9'.*choose one of"):
        dt.Engine(small_model(), dt.SpecConfig(kv_cache_dtype="fp9"))
    with pytest.raises(dt.ConfigError, match="page_size must be a power of two"):
        dt.Engine(small_model(), dt.SpecConfig(page_size=24))


def test_commit_moves_at_most_the_path_whatever_the_window():
    """Commit copies the accepted path's rows (and the entries it closed), never the window."""
    for window in (8, 64):
        model = small_model(window=window)
        eng = engine_for(model)
        req = eng.prefill(prompt(70, 8))
        tree = random_tree(req.root_token, 30, 10, 3, 9)
        eng.verify([req], [tree])
        leaf = int(tree.leaves[torch.argmax(tree.depth[tree.leaves])])
        path = tree.path[leaf][tree.path[leaf] >= 0]
        moves = plan_moves(eng.runtime.pages, eng.runtime.layout, [req.row], [req.seq_len], [path])
        assert moves.recent_src.numel() <= path.numel() - 1, f"{window=}"
        for m, src in moves.entry_src.items():
            assert src.numel() <= path.numel() // m + 1, f"{window=} {m=}"


def test_padded_bucket_equals_unpadded_run():
    """Padding to a static-shape bucket changes no real row and never reaches committed state."""
    model = small_model()
    plain = engine_for(model, topk=4, steps=6, nodes=16)
    padded = engine_for(model, topk=4, steps=6, nodes=16, cuda_graph_max_bs=4)
    prompts = [prompt(n, 30 + n) for n in (9, 22, 17)]
    trees = [random_tree(int(p[-1]), n, 6, 3, n) for p, n in zip(prompts, (16, 5, 1))]
    states = []
    for eng in (plain, padded):
        reqs = [eng.prefill(p) for p in prompts]
        out = eng.verify(reqs, trees)
        states.append((eng, reqs, out))
    (_, ra, oa), (_, rb, ob) = states
    for b in range(3):
        err = float(((oa.logits[b] - ob.logits[b]).abs() / oa.logits[b].abs().amax(-1, keepdim=True)).max())
        assert err <= 1e-6, f"request {b}: padded run differs by {err:.2e}"  # GEMM row-count rounding only
    paths = [(0,), (0,), (0,)]
    for eng, reqs, out in states:
        accs = [dt.Acceptance(tuple(tree.path[n - 1][tree.path[n - 1] >= 0].tolist()), 3, r.request_id, out.verify_id)
                for tree, r, n in zip(trees, reqs, (16, 5, 1))]
        paths = [a.path for a in accs]
        eng.commit(reqs, accs, out)
    for a, b in zip(ra, rb):
        assert a.seq_len == b.seq_len
        for la, lb in zip(plain.state_summary(a), padded.state_summary(b)):
            for k in la:  # rows computed in GEMMs of different row counts: rounding only
                if la[k].numel():
                    diff = float((la[k].double() - lb[k].double()).abs().max())
                    assert diff <= 1e-5 * max(1.0, float(la[k].abs().max())), f"{k}: {diff:.2e}"
    assert any(len(p) > 1 for p in paths)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA device")
def test_cuda_graph_replay_equals_eager():
    model = dt.load_model(small_model().hf, device="cuda")
    eager = engine_for(model, topk=4, steps=6, nodes=16)
    graphed = engine_for(model, topk=4, steps=6, nodes=16, cuda_graph_max_bs=4)
    prompts = [prompt(n, 40 + n) for n in (9, 22, 17)]
    for round_ in range(3):  # the second and third verify replay the captured graph
        trees = [random_tree(int(p[-1]), 12, 6, 3, round_ * 7 + i) for i, p in enumerate(prompts)]
        outs = []
        for eng in (eager, graphed):
            reqs = [eng.prefill(p) for p in prompts]
            outs.append(eng.verify(reqs, trees))
        for a, b in zip(outs[0].logits, outs[1].logits):
            assert torch.allclose(a, b, rtol=REL_TOL, atol=REL_TOL * float(a.abs().max()))
    assert len(graphed._graphs.graphs) == 1


def test_engine_window_table_equals_public_sglang_builder():
    """The engine's per-row window lists are what dt.serving.tree_swa_page_indices gives from
    SGLang-shaped inputs (req_to_token, full_to_swa_mapping) over the same page tables."""
    model = small_model()
    eng = engine_for(model, page_size=16)
    reqs = [eng.prefill(prompt(n, n)) for n in (3, 30, 61)]
    trees = [random_tree(r.root_token, 10, 6, 3, i) for i, r in enumerate(reqs)]
    plan = eng.plan(reqs, trees)
    pages = eng.runtime.pages
    parents = torch.stack([t.parents for t in trees])
    got = dt.serving.tree_swa_page_indices(pages.req_to_token(), pages.full_to_swa_mapping(),
                                           torch.tensor(plan.rows), torch.tensor(plan.seq_lens), parents,
                                           model.window)
    w = model.window
    assert torch.equal(got[:, :w].long(), plan.swa_index)
    assert bool((got[:, w:] == -1).all())


def test_prefill_batch_equals_one_by_one_and_is_all_or_nothing():
    model = small_model()
    eng = dt.Engine(model, dt.SpecConfig(prefill_chunk=7, num_steps=6))
    prompts = [prompt(n, 60 + n) for n in (1, 9, 30)]
    together = eng.prefill_batch(prompts)
    alone = [eng.prefill(p) for p in prompts]
    for a, b in zip(together, alone):
        assert a.seq_len == b.seq_len and a.root_token == b.root_token and torch.equal(a.tokens, b.tokens)
        for la, lb in zip(eng.state_summary(a), eng.state_summary(b)):
            for k in la:  # rows computed in GEMMs of other row counts: rounding only
                assert torch.allclose(la[k], lb[k], atol=1e-5, rtol=0), k
        if b.new_hidden is not None:
            assert torch.allclose(a.new_hidden, b.new_hidden, atol=1e-5, rtol=0)
    used = eng.runtime.live_slots()
    with pytest.raises(dt.InputError, match="outside the vocabulary"):
        eng.prefill_batch([prompts[1], [1, 2, 10_000]])
    assert eng.runtime.live_slots() == used


def test_graph_cache_holds_a_bounded_number_of_graphs(monkeypatch):
    """Each new context-width bucket captures a graph; the cache keeps at most max_graphs of
    them, dropping the least recently replayed (capture itself needs CUDA: stood in for here)."""
    import dsv4_tree.executor.graphs as graphs_mod
    from dsv4_tree.executor.forward import RowsRun

    captured, replays = [], []

    class Graph:
        def __init__(self, key):
            self.key = key

        def replay(self):
            replays.append(self.key)

    out = RowsRun(torch.zeros(1, 4), torch.zeros(1), torch.zeros(1, 1, 2))
    cache = graphs_mod.GraphCache(None, None, None, max_graphs=3)

    def capture(plan):
        captured.append(plan)
        return graphs_mod._Captured(Graph(plan), plan, out)

    monkeypatch.setattr(cache, "_capture", capture)
    monkeypatch.setattr(graphs_mod, "_copy_into", lambda static, new: None)
    for key in ["a", "b", "c", "a", "d", "e", "a", "b"]:  # buckets in the order a long run meets them
        cache.run(key, key)
    assert captured == ["a", "b", "c", "d", "e", "b"]  # "b" was dropped for "e", "a" kept by its replays
    assert list(cache.graphs) == ["e", "a", "b"] and replays == ["a", "b", "c", "a", "d", "e", "a", "b"]
