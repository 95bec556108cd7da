"""A graphed step (table build + forward captured together, one graph per bucket) equals the
eager step, and the number of graphs follows the buckets, not the context lengths. On CPU the
capture is executor/graphs.py's eager stand-in (replay reruns the step into the static outputs);
tests/test_serving.py has the CUDA replay test."""
import dsv4_tree as dt
from cases import engine_for, prompt, random_tree, small_model
from dsv4_tree.executor.graphs import GraphCache, eager_capture


def graphed_engine(model, **spec):
    eng = engine_for(model, topk=4, steps=6, nodes=16, cuda_graph_max_bs=4, **spec)
    eng._graphed = lambda: True  # take the CUDA path with the stand-in capture
    eng._graphs = GraphCache(eng.model, eng.runtime, eng.ops, capture=eager_capture)
    return eng


def test_graphed_steps_equal_eager_steps_and_graphs_follow_buckets():
    model = small_model()
    eager, graphed = engine_for(model, topk=4, steps=6, nodes=16), graphed_engine(model)
    lengths = [(9, 22, 17), (30, 12, 5, 7), (300, 40, 20)]  # the third round: a 2-page context bucket
    states = {}
    for rnd, lens in enumerate(lengths):
        prompts = [prompt(n, 40 + n + rnd) for n in lens]
        trees = [random_tree(int(p[-1]), 12, 6, 3, rnd * 7 + i) for i, p in enumerate(prompts)]
        for eng in (eager, graphed):
            reqs = [eng.prefill(p) for p in prompts]
            plan = eng.plan(reqs, trees)
            assert (plan.staged is not None) == (eng is graphed) and (plan.positions is None) == (eng is graphed)
            out = eng.run_plan(plan, reqs)
            assert out.plan.positions is not None and out.plan.compress
            accs = eng.accept_greedy(reqs, trees, out)
            eng.commit(reqs, accs, out)
            states[eng] = (out, reqs, accs)
        (oa, ra, aa), (ob, rb, ab) = states[eager], states[graphed]
        for b in range(len(lens)):
            scale = oa.logits[b].abs().amax(-1, keepdim=True)
            err = float(((oa.logits[b] - ob.logits[b]).abs() / scale).max())
            assert err <= 1e-5, f"round {rnd} request {b}: graphed differs by {err:.2e}"  # padded GEMMs: rounding
        assert [a.path for a in aa] == [a.path for a in ab], f"round {rnd}: accepted paths differ"
        for a, b in zip(ra, rb):
            assert a.seq_len == b.seq_len and a.root_token == b.root_token
            for la, lb in zip(eager.state_summary(a), graphed.state_summary(b)):
                for k in la:
                    if la[k].numel():
                        diff = float((la[k].double() - lb[k].double()).abs().max())
                        assert diff <= 1e-5 * max(1.0, float(la[k].abs().max())), f"round {rnd} {k}: {diff:.2e}"
            eager.release(a)
            graphed.release(b)
    # rounds 1 and 2 share a bucket (<= 4 requests, one page); round 3 needs two pages
    assert len(graphed._graphs.graphs) == 2, list(graphed._graphs.graphs)


def test_cuda_graphs_are_the_default_on_cuda_only_and_eager_stays_selectable():
    model = small_model()
    for limit, on_cuda, graphed in ((None, False, False), (None, True, True), (0, True, False), (4, True, True)):
        eng = engine_for(model, topk=4, steps=6, nodes=16, **({} if limit is None else {"cuda_graph_max_bs": limit}))
        assert eng.spec.cuda_graph_max_bs == limit and not eng._graphed()  # a CPU model never captures
        if on_cuda:
            eng._graphed = lambda: True  # what a CUDA model answers
        req = eng.prefill(prompt(10, 1))
        plan = eng.plan([req], [dt.DraftTree.chain([req.root_token])])
        assert (plan.staged is not None) == graphed and (plan.bucket is not None) == graphed, f"{limit=} {on_cuda=}"
