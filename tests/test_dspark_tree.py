"""DSpark Markov trees: every node's draft distribution equals a forced DSpark chain along its
path (the chain's reference), K = 1 is the chain, greedy generation equals Hugging Face's
(single, batched with queueing, EOS, near the position limit), sampled tree generation follows
the target (chi-square of the first token).

Bounds as in test_dspark_drafter.py: drafts against the per-request reference at relative 1e-4,
confidences at absolute 1e-5 (tolerances.md: packed rows round differently from the dense
reference)."""
from __future__ import annotations

import pytest
import torch

import dsv4_tree as dt
from dsv4_tree.checkpoint.dspark import DSparkSettings
from dsv4_tree.checkpoint.tiny import random_dspark
from dsv4_tree.drafters.base import TreeShape
from dsv4_tree.drafters.dspark import DSparkDrafter
from dsv4_tree.drafters.dspark_graphs import padded_block
from dsv4_tree.drafters.dspark_rows import markov_walk
from dsv4_tree.drafters.dspark_cache import DSparkContext, bring_up, pack_contexts
from dsv4_tree.drafters.dspark_tree import expand_markov
from dsv4_tree.reference import relative_error
from dsv4_tree.reference.dspark import ref_dspark_block, ref_dspark_chain, ref_target_features
from dsv4_tree.train.corpus import heldout_prompt
from test_adaptive_depth import hf_greedy
from test_adaptive_sampling import chi2_p
from test_dspark_drafter import check_limit_and_eos

GAMMA = 4


@pytest.fixture(scope="module")
def model():
    return dt.load_model(dt.tiny_checkpoint())


def _module(model, gamma=GAMMA, seed=0):
    return random_dspark(model.config, DSparkSettings(gamma, 8, model.vocab_size - 5, (1, 2, 3)), seed=seed)


def _prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 500, (n,), generator=g).tolist()


def _spec(topk, steps, nodes, **kw):
    return dt.SpecConfig(eagle_topk=topk, num_steps=steps, num_draft_tokens=nodes, **kw)


def _eagle2_reference(module, base, hidden, anchor, topk, steps, nodes, branching):
    """The tree the wave expansion must select, node by node from the reference chain's logits:
    -> (tokens, parents) in candidate order, and the smallest relative score gap at any cut
    (frontiers, the final best nodes - 1), under which rounding may reorder candidates."""
    def child_logits(path, spine):
        d = len(path)
        if branching == "markov" or spine:
            return ref_dspark_chain(module, base[:d], hidden[:d], torch.tensor(path))[0][d - 1]
        return base[d - 1].float()

    cands, gaps = [], []

    def expand(parent, path, score, spine):
        lg = child_logits(path, spine)
        p = torch.softmax(lg, -1)
        for j, t in enumerate(lg.topk(topk).indices.tolist()):
            cands.append(dict(score=score * float(p[t]), tok=t, parent=parent, path=path + [t], spine=spine and j == 0))

    def best(ids, m):
        order = sorted(ids, key=lambda i: -cands[i]["score"])  # stable: lower id first on a tie
        if m < len(order):
            a, b = cands[order[m - 1]]["score"], cands[order[m]]["score"]
            gaps.append((a - b) / a)
        return order[:m]

    expand(-1, [anchor], 1.0, True)
    frontier = list(range(topk))
    for _ in range(1, steps):
        start = len(cands)
        for f in frontier:
            expand(f, cands[f]["path"], cands[f]["score"], cands[f]["spine"])
        frontier = best(range(start, len(cands)), topk)
    chosen = sorted(best(range(len(cands)), nodes - 1))
    local = {c: i + 1 for i, c in enumerate(chosen)}
    tokens = [anchor] + [cands[c]["tok"] for c in chosen]
    parents = [-1] + [0 if cands[c]["parent"] < 0 else local[cands[c]["parent"]] for c in chosen]
    return tokens, parents, min(gaps, default=1.0)


@pytest.mark.parametrize("topk,steps,nodes,branching,seed", [(2, 4, 8, "markov", 0), (4, 3, 12, "markov", 1),
                                                              (3, 4, 16, "base", 2), (4, 2, 6, "markov", 3)])
def test_every_node_draws_from_the_forced_chain_along_its_path(model, topk, steps, nodes, branching, seed):
    module = _module(model, seed=seed)
    eng = dt.Engine(model, _spec(topk, steps, nodes, draft_depth="fixed"))
    drafter = DSparkDrafter(model, TreeShape(topk, steps, nodes), module=module, record=True, branching=branching)
    eng.register_drafter(drafter)
    reqs = eng.prefill_batch([_prompt(40 + 7 * seed, seed), _prompt(9, 10 + seed)])
    trees = drafter.draft(eng, reqs)
    compared = 0
    for req, tree in zip(reqs, trees):
        rec = drafter.records[req.request_id]
        assert rec.tree is tree and tree.num_nodes == nodes and tree.max_depth <= steps
        feats = ref_target_features(model, req.tokens, module.settings.target_layer_ids)
        base, hidden = ref_dspark_block(model, module, feats, req.root_token)
        assert relative_error(rec.base, base) < 1e-4
        depth = tree.depth.tolist()
        on_spine = {0}
        for n in range(1, nodes):
            path = tree.path_tokens(n)  # root .. n
            d = depth[n]
            assert len(path) == d + 1
            parent = int(tree.parents[n])
            spine_child = parent in on_spine and n == min(tree.children(parent))
            if spine_child:
                on_spine.add(n)
            ref_logits, ref_conf = ref_dspark_chain(module, base[:d], hidden[:d], path[:d])
            want = ref_logits[d - 1] if branching == "markov" or parent in on_spine else base[d - 1].float()
            assert relative_error(rec.logits[n - 1], want) < 1e-4, (n, path)
            assert abs(float(rec.confidence[n - 1] - ref_conf[d - 1])) < 1e-5
            # the node is one of its parent's top-k children (drawn from exactly that row)
            assert int(path[-1]) in rec.logits[n - 1].topk(topk).indices.tolist()
        # siblings are distinct tokens (top-k of one distribution)
        for u in range(nodes):
            kids = [int(tree.tokens[c]) for c in tree.children(u)]
            assert len(kids) == len(set(kids)) <= topk
        # the nodes chosen: EAGLE-2's frontiers and best nodes - 1 by path probability, unless a cut
        # is a near tie that the packed rows' rounding (relative 1e-4) may order either way
        tokens, parents, gap = _eagle2_reference(module, base, hidden, req.root_token, topk, steps, nodes, branching)
        if gap > 1e-3:
            compared += 1
            assert tree.tokens.tolist() == tokens and tree.parents.tolist() == parents
    assert compared >= 1, "every request's selection had a near tie: pick other seeds"


def test_k1_expansion_is_the_chain_bitwise(model):
    module = _module(model, seed=5)
    eng = dt.Engine(model, _spec(1, GAMMA, GAMMA + 1))
    chain = DSparkDrafter(model, TreeShape(1, GAMMA, GAMMA + 1), module=module, record=True)
    eng.register_drafter(chain)
    for prompts in ([_prompt(33, 1)], [_prompt(21, 2), _prompt(60, 3)]):
        reqs = eng.prefill_batch(prompts)
        contexts = [DSparkContext.empty(model, module) for _ in reqs]
        bring_up(model, module, contexts, reqs)
        tables, lengths = pack_contexts(contexts, model.window)
        anchors = torch.tensor([r.root_token for r in reqs])
        with torch.inference_mode():
            blk = padded_block(model, module, anchors, torch.tensor([r.seq_len for r in reqs]), tables,
                               torch.tensor(lengths), model.window)
            exp = expand_markov(module, blk, anchors, 1, GAMMA, keep_logits=True)
            tokens, logits = markov_walk(module, blk, anchors)
        got = torch.cat([anchors.unsqueeze(1)] + [t.reshape(len(reqs), 1) for t in exp.token_list], 1)
        assert torch.equal(got, tokens)
        assert torch.equal(torch.stack([exp.logit_list[0]] + [x[:, 0] for x in exp.logit_list[1:]], 1), logits)
        for r in reqs:
            eng.release(r)


def test_greedy_tree_generation_equals_hugging_face(model):
    module = _module(model, seed=7)
    for size in ("fixed", "adaptive"):
        eng = dt.Engine(model, _spec(4, GAMMA, 10, draft_depth=size))
        drafter = DSparkDrafter(model, TreeShape(4, GAMMA, 10), module=module)
        prompt = _prompt(45, 4)
        res = eng.generate(prompt, 24, drafter=drafter, progress=False)
        assert res.tokens == hf_greedy(model, prompt, 24)
    prompts = [_prompt(n, 10 + n) for n in (7, 30, 12)]
    queued = dt.Engine(model, _spec(2, 3, 8, max_requests=2))  # three prompts queue for two rows
    outs = queued.generate_batch(prompts, [10, 16, 6], drafter=DSparkDrafter(model, TreeShape(2, 3, 8), module=module),
                                 progress=False)
    for p, o, n in zip(prompts, outs, (10, 16, 6)):
        assert o.tokens == hf_greedy(model, p, n)


def test_greedy_trees_near_the_position_limit_and_at_eos(model):
    module = _module(model, seed=8)
    eng = dt.Engine(model, _spec(3, GAMMA, 12))
    check_limit_and_eos(model, eng, DSparkDrafter(model, TreeShape(3, GAMMA, 12), module=module))


def test_sampled_tree_first_tokens_follow_the_target():
    """A sampling run drafts drawn trees (drafters/dspark_drawn.py: the top tokens chosen, the
    spine drawn); verify's drawn-tree rejection sampling against their rows must give the
    target's distribution for the first emitted token."""
    trained = dt.load_model(dt.trained_checkpoint())
    module = random_dspark(trained.config, DSparkSettings(GAMMA, 8, 258, (1, 2, 3)), seed=1)
    eng = dt.Engine(trained, _spec(4, 2, 8, max_requests=64, accept="sampling", draft_depth="fixed"))
    drafter = DSparkDrafter(trained, TreeShape(4, 2, 8), module=module)
    eng.register_drafter(drafter)
    g = torch.Generator().manual_seed(0)
    drafter.set_sampling(1.0, 1.0, g)
    reqs = eng.prefill_batch([heldout_prompt(40, 3)] * 64)
    target = dt.verify.sampling.target_probs(
        eng.verify(reqs[:1], [dt.DraftTree.chain([reqs[0].root_token])]).logits[0][0], 1.0)
    counts = torch.zeros(trained.vocab_size)
    in_tree = 0
    for _ in range(40):
        trees = drafter.draft(eng, reqs)
        out = eng.verify(reqs, trees)
        for tree, acc in zip(trees, eng.accept_sampling(reqs, trees, out, 1.0, 1.0, g)):
            first = int(tree.tokens[acc.path[1]]) if len(acc.path) > 1 else acc.bonus
            counts[first] += 1
            in_tree += len(acc.path) > 1
    assert chi2_p(counts, target) > 1e-3
    assert in_tree > 0.2 * counts.sum(), "the trees must hold the target's token often enough for this test to bite"


def test_the_registry_cli_and_custom_generate_draft_dspark_trees(capsys):
    from transformers import DeepseekV4ForCausalLM

    hf = DeepseekV4ForCausalLM.from_pretrained(str(dt.trained_checkpoint()), dtype=torch.float32).eval()
    ids = torch.tensor([heldout_prompt(80, 2)])
    want = hf.generate(ids, max_new_tokens=24, do_sample=False)
    tree = hf.generate(ids, max_new_tokens=24, do_sample=False, custom_generate=dt.custom_generate,
                       dsv4_eagle_topk=4)
    assert torch.equal(tree, want)
    specs = {(k[0].eagle_topk, k[0].num_steps) for k in hf.__dict__["_dsv4_tree_engines"]}
    assert (4, 5) in specs, "the shipped DSpark module's tree, gamma = 5 deep"
    with pytest.raises(dt.ConfigError, match="at most dspark_block_size=5 deep"):
        hf.generate(ids, max_new_tokens=4, custom_generate=dt.custom_generate, dsv4_eagle_topk=4, dsv4_num_steps=6,
                    dsv4_num_draft_tokens=8)
    for bad in (dict(dsv4_eagle_topk="4"), dict(dsv4_eagle_topk=4, dsv4_num_steps="3")):
        with pytest.raises(dt.ConfigError, match="must be an int"):
            hf.generate(ids, max_new_tokens=4, custom_generate=dt.custom_generate, **bad)
    from dsv4_tree.cli import main

    assert main(["demo", "--drafter", "dspark", "--topk", "4", "--rounds", "2", "--prompt-len", "40"]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "topk=4" in out


def test_sampled_generation_on_sized_trees_follows_the_target():
    """generate_batch, sampling, the shipped DSpark's drawn trees sized by the policy, copies of one
    prompt queued for fewer rows: the first generated tokens (verified on the trees: the prompt's
    last token is the root) follow the target's distribution."""
    from dsv4_tree.reference.per_path import per_path_logits
    from test_batch_scheduling import ROWS, SAMPLES, TEMPERATURE

    trained = dt.load_model(dt.trained_checkpoint())
    ids = torch.tensor(heldout_prompt(28, 4))
    probs = torch.softmax(per_path_logits(trained, ids[:-1], dt.DraftTree.chain(ids[-1:]))[0].double() / TEMPERATURE, -1)
    spec = _spec(4, 3, 8, accept="sampling", max_requests=ROWS, page_size=16, max_total_tokens=ROWS * 48)
    assert spec.depth_mode == "adaptive"
    got = dt.Engine(trained, spec).generate_batch([ids] * SAMPLES, 2, drafter="dspark", temperature=TEMPERATURE,
                                                  generator=torch.Generator().manual_seed(0), progress=False)
    first = torch.zeros(probs.numel(), dtype=torch.float64)
    for g in got:
        first[g.tokens[0]] += 1
    assert chi2_p(first, probs) > 1e-3, first[first > 0].tolist()
    drafted = sum(g.stats.accept_lengths[0] >= 2 for g in got)  # the first token was an accepted tree node
    assert drafted >= SAMPLES // 4, drafted


def test_frontier_children_at_a_fixed_shape_without_a_host_read(model, monkeypatch):
    """One bias row per frontier node (B x F, whatever the tokens: a dedupe would have a
    data-dependent shape), nothing read on the host; nodes of one request sharing a token get the
    same children, an unbiased node U_k's own."""
    from dsv4_tree.diagnostics import forbid_host_sync
    from dsv4_tree.drafters import dspark_tree

    module = _module(model, seed=9)
    vocab, d = model.vocab_size, model.config.hidden_size
    g = torch.Generator().manual_seed(0)
    base, hidden = torch.randn(2, vocab, generator=g), torch.randn(2, d, generator=g)
    tokens = torch.tensor([[5, 9, 5], [5, 5, 7]])  # request 0: 5 twice; request 1: 5 twice (its own base)
    biased = torch.tensor([[True, True, True], [True, True, False]])  # request 1's 7 branches from U_k alone
    seen, real = [], module.markov_bias
    monkeypatch.setattr(module, "markov_bias", lambda prev: seen.append(prev.clone()) or real(prev))
    with torch.inference_mode(), forbid_host_sync():
        probs, ids, logits, conf = dspark_tree._children(module, base, hidden, tokens, biased, 3)
    assert len(seen) == 1 and seen[0].tolist() == [5, 9, 5, 5, 5, 7]  # one row per node
    assert torch.equal(ids[0, 0], ids[0, 2]) and torch.allclose(logits[0, 0], logits[0, 2], rtol=0, atol=1e-6)
    assert torch.allclose(logits[1, 0], logits[1, 1], rtol=0, atol=1e-6)
    assert not torch.allclose(logits[0, 0], logits[1, 0])  # each request's own base
    assert torch.equal(logits[1, 2], base[1].float())  # unbiased: U_k itself
    with torch.inference_mode():
        want = dspark_tree.markov_logits(module, base[0], torch.tensor(9))
    assert torch.allclose(logits[0, 1], want, rtol=0, atol=1e-5)


def test_batched_greedy_trees_stop_at_eos_each_on_its_own(model):
    module = _module(model, seed=10)
    prompts = [_prompt(n, 30 + n) for n in (12, 25)]
    full = [hf_greedy(model, p, 14) for p in prompts]
    eos = full[0][6]  # the first prompt meets it at its 7th token; the second maybe never
    eng = dt.Engine(model, _spec(3, GAMMA, 10))
    outs = eng.generate_batch(prompts, 14, drafter=DSparkDrafter(model, TreeShape(3, GAMMA, 10), module=module),
                              eos_token_id=eos, progress=False)
    for want, out in zip(full, outs):
        cut = want[: want.index(eos) + 1] if eos in want else want
        assert out.tokens == cut and out.stop_reason == ("eos" if eos in want else "length")
