"""Adaptive DSpark drafts under one verify budget per step (budget/budget_policy.py): chains cut
to SGLang's lengths from confidences two rounds old, budgeted trees that grow when rows are cheap
and shrink when they are dear (given tables and lines learnt on a fake clock), the start-up
profile recovering a priced line, greedy output equal to Hugging Face's, and sampled chains kept
lossless by the lag (the same chi-square shows the bias of a budget read from this round's draws)."""
from __future__ import annotations

import pytest
import torch

import dsv4_tree as dt
from dsv4_tree.checkpoint.dspark import DSparkSettings
from dsv4_tree.checkpoint.tiny import random_dspark
from dsv4_tree.drafters import dspark_drawn as drawn_mod
from dsv4_tree.drafters.base import TreeShape
from dsv4_tree.budget.budget_policy import BudgetPolicy
from dsv4_tree.budget.cost_profile import profile_costs
from dsv4_tree.budget.cost_table import LineTable, StepsPerSecondTable
from dsv4_tree.drafters.dspark import DSparkDrafter
from dsv4_tree.budget.verify_budget import SURVIVAL_EPS, choose_budget, survival, verify_lens
from dsv4_tree.train.corpus import heldout_prompt
from dsv4_tree.verify.sampling import target_probs
from test_adaptive_depth import Clock, hf_greedy
from test_adaptive_sampling import chi2_p

GAMMA = 4
CHAIN = TreeShape(1, GAMMA, GAMMA + 1)
TREE = TreeShape(3, GAMMA, 10)


@pytest.fixture(scope="module")
def model():
    return dt.load_model(dt.tiny_checkpoint())


@pytest.fixture(scope="module")
def module(model):
    return random_dspark(model.config, DSparkSettings(GAMMA, 8, model.vocab_size - 5, (1, 2, 3)), seed=11)


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 500, (9 + 6 * i,), generator=g).tolist() for i in range(n)]


def _spec(shape, **kw):
    return dt.SpecConfig(eagle_topk=shape.topk, num_steps=shape.num_steps, num_draft_tokens=shape.num_draft_tokens,
                         draft_depth="adaptive", **kw)


def test_adaptive_chains_are_sglangs_lengths_from_two_rounds_old_confidences(model, module):
    table = LineTable((1, 4), (1.0, 1.0), (0.12, 0.12))
    eng = dt.Engine(model, _spec(CHAIN))
    drafter = DSparkDrafter(model, CHAIN, module=module, record=True, cost_table=table)
    eng.register_drafter(drafter)
    reqs = eng.prefill_batch(_prompts(4))
    history, lens = [], []
    for _ in range(5):
        trees = drafter.draft(eng, reqs)
        conf = torch.stack([drafter.records[r.request_id].confidence for r in reqs])
        lagged = history[-2] if len(history) >= 2 else torch.ones_like(conf)
        want = verify_lens(conf, choose_budget(survival(lagged), table).budget)
        assert [t.num_nodes for t in trees] == want.tolist()
        for t, r in zip(trees, reqs):  # the first nodes of the chain drafted
            assert t.tokens.tolist() == drafter.records[r.request_id].tokens[: t.num_nodes].tolist()
        history.append(conf)
        lens += want.tolist()
        out = eng.verify(reqs, trees)
        eng.commit(reqs, eng.accept_greedy(reqs, trees, out), out)
        drafter.end_round(reqs)
    assert 1 < sum(lens) / len(lens) < GAMMA + 1, lens  # rows priced to cut some chains, not all


def test_adaptive_greedy_equals_hugging_face_for_chains_and_trees(model, module, monkeypatch):
    prompts = _prompts(3, seed=5)
    want = [hf_greedy(model, p, 20) for p in prompts]
    for shape in (CHAIN, TREE):
        eng = dt.Engine(model, _spec(shape, max_requests=2))  # three prompts queue for two rows
        verified, real = [], eng.verify
        monkeypatch.setattr(eng, "verify", lambda reqs, trees: verified.extend(t.num_nodes for t in trees)
                            or real(reqs, trees))
        outs = eng.generate_batch(prompts, 20, drafter=DSparkDrafter(model, shape, module=module), progress=False)
        assert [o.tokens for o in outs] == want, shape
        # round_nodes: what each request-round verified, root included
        assert all(len(o.stats.round_nodes) == o.stats.rounds for o in outs)
        assert sorted(n for o in outs for n in o.stats.round_nodes) == sorted(verified)
        assert 1 < sum(verified) / len(verified) < shape.num_draft_tokens, verified
        state = outs[0].stats.depth  # what the CLI's "rounds:" line shows
        kind = "chain" if shape is CHAIN else "tree"
        assert state.kind == kind and state.describe().startswith(f"{kind} budget ")
        assert ("node values" in state.describe()) == (kind == "tree")


def _sizes(model, module, shape, clock, per_node, monkeypatch, prompt, n_new=30):
    eng = dt.Engine(model, _spec(shape))
    drafter = DSparkDrafter(model, shape, module=module, clock=clock)
    real = eng.verify
    monkeypatch.setattr(eng, "verify", lambda reqs, trees: (setattr(clock, "t", clock.t + 1.0 + per_node * sum(
        t.num_nodes for t in trees)), real(reqs, trees))[1])
    res = eng.generate(prompt, n_new, drafter=drafter, progress=False)
    return res


def test_budgeted_trees_grow_when_rows_are_cheap_and_shrink_when_dear(model, module, monkeypatch):
    prompt = _prompts(1, seed=2)[0]
    want = hf_greedy(model, prompt, 30)
    sizes = {}
    for label, per_node in (("cheap", 1e-4), ("dear", 1.0)):
        res = _sizes(model, module, TREE, Clock(), per_node, monkeypatch, prompt)
        assert res.tokens == want, label
        nodes = res.stats.round_nodes
        assert nodes[:2] == [TREE.num_draft_tokens, 1 + (TREE.num_draft_tokens - 1) // 2], nodes  # the probes
        sizes[label] = sorted(nodes[2:])[len(nodes[2:]) // 2]
        assert res.stats.depth.lines[1] is not None
    assert sizes["dear"] == 1 and sizes["cheap"] > 4, sizes


def test_a_busy_batch_gets_fewer_nodes_per_request(model, module):
    table = LineTable((1, 8), (1.0, 1.0), (0.004, 0.03))  # a node costs 7.5x more (in round time) at 8 requests
    eng = dt.Engine(model, _spec(TREE, max_requests=8))
    drafter = DSparkDrafter(model, TREE, module=module, cost_table=table)
    eng.register_drafter(drafter)
    reqs = eng.prefill_batch(_prompts(8, seed=3))
    alone = [drafter.draft(eng, [r])[0].num_nodes for r in reqs]
    busy = [t.num_nodes for t in drafter.draft(eng, reqs)]
    assert sum(busy) < sum(alone) and max(alone) > 1, (alone, busy)


def test_profile_costs_recovers_a_priced_line(model, module, monkeypatch):
    clock = Clock()
    eng = dt.Engine(model, _spec(CHAIN))
    drafter = DSparkDrafter(model, CHAIN, module=module, clock=clock, size="adaptive")
    real = eng.verify
    monkeypatch.setattr(eng, "verify", lambda reqs, trees: (setattr(clock, "t", clock.t + 0.5 + 0.1 * len(reqs) + 0.01 * sum(
        t.num_nodes for t in trees)), real(reqs, trees))[1])
    table = profile_costs(eng, drafter, _prompts(3), batch_sizes=(1, 3), nodes=(1, 3), rounds=2, clock=clock)
    assert table.batch_sizes == (1, 3)
    assert table.base_seconds == pytest.approx((0.6, 0.8)) and table.seconds_per_node == pytest.approx((0.01, 0.01))
    assert drafter.policy.forced_nodes is None and eng.runtime.pages.free_rows == eng.spec.max_requests
    with pytest.raises(dt.InputError, match="adaptive DSpark drafter"):
        profile_costs(eng, DSparkDrafter(model, CHAIN, module=module, size="fixed"), _prompts(1), batch_sizes=(1,))


class _NoLag(BudgetPolicy):
    """The budget from this round's survival: what the lag exists to prevent."""

    def chain(self, model, request_ids, confidence):
        window = survival(confidence).reshape(-1)
        values = torch.sort(window[window >= SURVIVAL_EPS].double(), descending=True).values
        self.last_budget = self._budget(model, values, len(request_ids))
        return verify_lens(confidence, self.last_budget)

    def chain_fixed(self, model, request_ids, confidence):  # what a sampling run's drawn chain asks
        lens = self.chain(model, request_ids, confidence)
        self._unsettled = (torch.tensor(self.last_budget), None)
        return lens


def test_the_lag_keeps_sampled_adaptive_chains_lossless(monkeypatch):
    """One request, the same state each sample (verify does not commit). The confidences say drafts
    2.. survive only after token A, and the table pays for a long chain only: read from this round,
    draft 1 is verified only when it is A, and A comes out too often; two rounds old, it is not."""
    trained = dt.load_model(dt.trained_checkpoint())
    shape = TreeShape(1, 5, 6)
    eng = dt.Engine(trained, dt.SpecConfig(eagle_topk=1, num_steps=5, num_draft_tokens=6, accept="sampling"))
    table = StepsPerSecondTable((1, 2, 6), (1.0, 0.5, 0.4), 64)
    probe = DSparkDrafter(trained, shape)  # a chain: fixed by default
    eng.register_drafter(probe)
    req = eng.prefill(heldout_prompt(40, 7))
    p = target_probs(eng.verify([req], [dt.DraftTree.chain([req.root_token])]).logits[0][0], 1.0)
    g = torch.Generator().manual_seed(0)
    probe.set_sampling(1.0, 1.0, g)
    q = probe.draft(eng, [req])[0].draft_probs[0].double()
    bias = torch.minimum(q, p) - q * p  # what admitting draft 1 only when it is A adds to A's probability
    token = int(torch.argmax(bias))
    assert float(bias[token]) > 0.1, "pick a prompt where the bias is large enough to see"
    real = drawn_mod.confidences  # a sampling run drafts its chain drawn (drafters/dspark_drawn.py)

    def designed(module, hidden, prev, temperature=None):
        c = torch.ones(prev.shape[0], prev.shape[1]) * (prev[:, 1:2] == token).float()
        c[:, 0] = 0.5
        return c.to(real(module, hidden, prev).device)

    monkeypatch.setattr(drawn_mod, "confidences", designed)
    pvalues = {}
    for label, policy in (("lag", BudgetPolicy(shape.num_draft_tokens - 1, table)),
                          ("no lag", _NoLag(shape.num_draft_tokens - 1, table))):
        drafter = DSparkDrafter(trained, shape, size="adaptive")
        drafter.policy = policy
        drafter.set_sampling(1.0, 1.0, g)
        counts = torch.zeros(trained.vocab_size, dtype=torch.float64)
        for _ in range(160):
            tree = drafter.draft(eng, [req])[0]
            acc = eng.accept_sampling([req], [tree], eng.verify([req], [tree]), 1.0, 1.0, g)[0]
            counts[int(tree.tokens[1]) if len(acc.path) > 1 else acc.bonus] += 1
        two = torch.stack([counts[token], counts.sum() - counts[token]])  # A against the rest: df 1
        pvalues[label] = (chi2_p(counts, p), chi2_p(two, torch.stack([p[token], 1 - p[token]])))
    assert min(pvalues["lag"]) > 1e-3 and pvalues["no lag"][1] < 1e-4, pvalues
