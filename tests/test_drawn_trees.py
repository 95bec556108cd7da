"""Drawn trees (drafters/dspark_drawn.py): what a sampling run's DSpark tree is, and the lossless
acceptance of trees that carry their draw distributions (verify/sampling.sample_drawn on the host,
verify/accept_batch.drawn_accept for a batch on the device).

A drawn tree's depth k: the spine token drawn from q (its row q) first, then the top s_k tokens
of q other than it (chosen: one-hot rows). The chi-square tests draw such trees from synthetic
p and q and check the first and second emitted tokens against the target; power checks show a
tree that misstates its rows fails the same test."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import dsv4_tree as dt
from dsv4_tree.drafters.dspark_drawn import drawn_parents, sibling_counts
from dsv4_tree.verify.accept_batch import drawn_accept
from dsv4_tree.verify.sampling import sample_drawn
from test_sampling import chi2_sf

V = 8
ALONE = SimpleNamespace(ranks=None)  # a model on one rank: agree_choice keeps the choice


def _chi2(counts, probs) -> float:
    keep = probs > 0
    exp = counts.sum() * probs[keep]
    return chi2_sf(float(((counts[keep] - exp) ** 2 / exp).sum()), int(keep.sum()) - 1)


def _distributions(seed):
    """p: the target at the root and at depth 1's spine node; q: the draft at the root and at the spine node."""
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(2, V, generator=g, dtype=torch.float64) * 1.5, -1)
    q = torch.softmax(torch.randn(2, V, generator=g, dtype=torch.float64) * 2.0, -1)
    return p, q


def _level(q_row, x, s):
    """Depth k's nodes as draw_tree makes them: the spine tokens x [T] (drawn from q_row), then
    the top s tokens of q_row other than each x -> (tokens [T, 1 + s], rows [T, 1 + s, V])."""
    top = q_row.topk(s + 1).indices
    sib = torch.stack([top[top != t][:s] for t in x.tolist()])
    tokens = torch.cat([x.unsqueeze(1), sib], 1)
    rows = torch.cat([q_row.expand(len(x), 1, V), torch.nn.functional.one_hot(sib, V).double()], 1)
    return tokens, rows


def _draw_trees(p, q, trials, seed, lie=False):
    """trials drawn trees: spine + 2 siblings at depth 1, spine + 1 sibling at depth 2 (parents:
    drawn_parents([2, 1])), as [trials, 6] tokens and [trials, 6, V] rows (row 0 unused);
    lie: the first spine row declared as the target's own (a drafter that misstates its draws)."""
    g = torch.Generator().manual_seed(seed)
    x1 = torch.multinomial(q[0], trials, replacement=True, generator=g)
    x2 = torch.multinomial(q[1], trials, replacement=True, generator=g)  # q at depth 2 need not depend on x1 here
    t1, r1 = _level(q[0], x1, 2)
    t2, r2 = _level(q[1], x2, 1)
    tokens = torch.cat([torch.zeros(trials, 1, dtype=torch.int64), t1, t2], 1)
    rows = torch.cat([torch.zeros(trials, 1, V, dtype=torch.float64), r1, r2], 1)
    if lie:
        rows[:, 1] = p[0]
    return tokens, rows


def _targets(p, trials):
    """[trials, 6, V]: the root's p[0] at node 0, p[1] at the spine node 1, uniform elsewhere (the
    leaves' rows: what follows an accepted sibling, not tested)."""
    probs = torch.full((trials, 6, V), 1.0 / V, dtype=torch.float64)
    probs[:, 0], probs[:, 1] = p[0], p[1]
    return probs


PARENTS = drawn_parents([2, 1])  # [-1, 0, 0, 0, 1, 1]


def test_the_drawn_shape_from_the_config():
    assert sibling_counts(4, 5, 16) == [3, 3, 3, 1, 0]
    assert sibling_counts(4, 5, 4) == [0, 0, 0]  # too few nodes for the spine: no siblings
    assert sibling_counts(1, 3, 4) == [0, 0, 0]  # topk 1: the chain
    assert PARENTS == [-1, 0, 0, 0, 1, 1]
    assert drawn_parents([0, 0]) == [-1, 0, 1]


def _walk_counts(tokens, rows, p, trials, seed):
    g = torch.Generator().manual_seed(seed)
    first, second = torch.zeros(V), torch.zeros(V)
    spine_hits = 0
    probs = _targets(p, 1)[0]
    for b in range(trials):
        tree = dt.DraftTree(tokens[b], torch.tensor(PARENTS), draft_probs=rows[b, 1:])
        path, bonus = sample_drawn(tree, probs, g)
        emitted = [int(tokens[b, i]) for i in path[1:]] + [bonus]
        first[emitted[0]] += 1
        if len(path) > 1 and path[1] == 1:
            spine_hits += 1
            second[emitted[1]] += 1
    return first, second, spine_hits


def test_the_host_walk_of_a_drawn_tree_follows_the_target():
    p, q = _distributions(0)
    trials = 6000
    tokens, rows = _draw_trees(p, q, trials, seed=1)
    first, second, hits = _walk_counts(tokens, rows, p, trials, seed=2)
    assert _chi2(first, p[0]) > 1e-3 and _chi2(second, p[1]) > 1e-3, (first, second)
    assert hits > trials // 10, "the spine must be accepted often enough for the second token's test to bite"
    lied = _walk_counts(*_draw_trees(p, q, trials, seed=1, lie=True), p, trials, seed=2)[0]
    assert _chi2(lied, p[0]) < 1e-6, "power: spine rows that misstate the draw are told apart"


def test_the_batched_acceptance_of_drawn_trees_follows_the_target():
    p, q = _distributions(3)
    trials = 20000
    tokens, rows = _draw_trees(p, q, trials, seed=4)
    parents = torch.tensor(PARENTS).expand(trials, -1)
    acc = drawn_accept(tokens, parents, _targets(p, trials), rows, max_depth=2, slots=3,
                       generator=torch.Generator().manual_seed(5))
    emitted_first = torch.where(acc.lengths >= 1, tokens.gather(1, acc.path[:, 1:2].clamp(min=0)).squeeze(1), acc.bonus)
    first = torch.bincount(emitted_first, minlength=V).double()
    on_spine = acc.path[:, 1] == 1
    second_tok = torch.where(acc.lengths >= 2, tokens.gather(1, acc.path[:, 2:3].clamp(min=0)).squeeze(1), acc.bonus)
    second = torch.bincount(second_tok[on_spine], minlength=V).double()
    assert _chi2(first, p[0]) > 1e-3 and _chi2(second, p[1]) > 1e-3, (first, second)
    assert int(on_spine.sum()) > trials // 10
    assert bool((acc.path[acc.lengths == 0, 1] == -1).all())
    # power: the same trees with the spine's row misstated
    tokens, rows = _draw_trees(p, q, trials, seed=4, lie=True)
    acc = drawn_accept(tokens, parents, _targets(p, trials), rows, max_depth=2, slots=3,
                       generator=torch.Generator().manual_seed(5))
    lied = torch.where(acc.lengths >= 1, tokens.gather(1, acc.path[:, 1:2].clamp(min=0)).squeeze(1), acc.bonus)
    assert _chi2(torch.bincount(lied, minlength=V).double(), p[0]) < 1e-6


def _level_rate(p, q, s):
    """Exact chance one drawn depth accepts a token: the spine x ~ q with min(1, p(x) / q(x)),
    else one of the s chosen tokens other than x with the residual r = max(p - q, 0) / its sum."""
    r = (p - q).clamp(min=0)
    r = r / r.sum()
    top = q.topk(s + 1).indices
    total = 0.0
    for x in range(V):
        a = min(1.0, float(p[x] / q[x]))
        total += float(q[x]) * (a + (1 - a) * float(r[top[top != x][:s]].sum()))
    return total


def test_a_drawn_level_accepts_at_least_the_drawn_chain():
    """The spine is the chain's draw, tried first; the chosen siblings only add after a
    rejection: one depth accepts sum min(p, q) + E[(1 - a) r(siblings)] >= sum min(p, q). The
    formula against the batched acceptance's measured rate, and strictly more on this pair (a draft
    flatter than the target; one sharper than it leaves the residual off q's top tokens, and
    the siblings add nothing)."""
    g = torch.Generator().manual_seed(7)
    p = torch.softmax(torch.randn(2, V, generator=g, dtype=torch.float64) * 2.0, -1)
    q = torch.softmax(p.log() * 0.5, -1)  # a flatter draft: the residual max(p - q, 0) sits on q's top tokens
    trials = 20000
    tokens, rows = _draw_trees(p, q, trials, seed=8)
    acc = drawn_accept(tokens, torch.tensor(PARENTS).expand(trials, -1), _targets(p, trials), rows, max_depth=2,
                       slots=3, generator=torch.Generator().manual_seed(9))
    expect = _level_rate(p[0], q[0], 2)
    rate = float((acc.lengths >= 1).double().mean())
    sd = (expect * (1 - expect) / trials) ** 0.5
    assert abs(rate - expect) < 5 * sd, (rate, expect)
    chain = float(torch.minimum(p[0], q[0]).sum())
    assert expect > chain + 10 * sd, "this pair: the siblings add measurably to the chain's draw"
    spine = float((acc.path[:, 1] == 1).double().mean())
    assert abs(spine - chain) < 5 * (chain * (1 - chain) / trials) ** 0.5, "the spine is accepted as the chain is"


def test_padding_and_a_lone_root_beside_drawn_trees():
    """Rows of different sizes in one batch: counts cut each row; a lone root draws its bonus from
    the target; a drawn chain (one child per node) is the one-slot case."""
    p, q = _distributions(10)
    tokens, rows = _draw_trees(p, q, 3, seed=11)
    counts = torch.tensor([6, 1, 4])
    parents = torch.tensor(PARENTS).expand(3, -1).clone()
    parents[1, 1:] = -1
    parents[2, 4:] = -1
    acc = drawn_accept(tokens, parents, _targets(p, 3), rows, counts, 2, 3, torch.Generator().manual_seed(12))
    assert int(acc.lengths[1]) == 0 and bool((acc.path[1, 1:] == -1).all())
    assert int(acc.lengths[2]) <= 1
    for b in (0, 2):
        ids = acc.path[b, 1 : 1 + int(acc.lengths[b])].tolist()
        assert all(0 < i < int(counts[b]) for i in ids)


@pytest.mark.parametrize("size", ["fixed", "adaptive"])
def test_a_sampling_run_drafts_drawn_dspark_trees(size):
    """DSparkDrafter under sampling, eagle_topk 3: fixed, each tree is drawn_parents' shape;
    adaptive, a subtree of it (the spine cut, siblings dropped). Every node's first child is the
    spine token, carrying the row its parent's Markov head gives (the record's logits at
    temperature 1); the other children are that row's top tokens other than the spine's, in
    order, with one-hot rows."""
    from dsv4_tree.drafters.base import TreeShape
    from dsv4_tree.drafters.dspark import DSparkDrafter
    from dsv4_tree.train.corpus import heldout_prompt
    from dsv4_tree.verify.sampling import target_probs

    model = dt.load_model(dt.trained_checkpoint())
    eng = dt.Engine(model, dt.SpecConfig(eagle_topk=3, num_steps=4, num_draft_tokens=9, accept="sampling",
                                         draft_depth=size))
    drafter = DSparkDrafter(model, TreeShape(3, 4, 9), record=True, size=size)
    if size == "adaptive":
        drafter.policy.forced_nodes = 2.5  # 4 spine nodes for 3 requests: the budget must cut
    drafter.set_sampling(1.0, 1.0, torch.Generator().manual_seed(0))
    eng.register_drafter(drafter)
    reqs = eng.prefill_batch([heldout_prompt(40, i) for i in range(3)])
    full = drawn_parents(sibling_counts(3, 4, 9))
    sizes = []
    for _ in range(4):  # adaptive: later rounds read the lagged budget
        trees = drafter.draft(eng, reqs)
        sizes += [t.num_nodes for t in trees]
        for req, tree in zip(reqs, trees):
            n = tree.num_nodes
            parents = tree.parents.tolist()
            assert tree.is_made and (size == "adaptive" or parents == full)
            q = target_probs(drafter.records[req.request_id].logits.double(), 1.0)  # [n - 1, V]: each node's parent's row
            rows = tree.draft_probs.cpu()
            for u in range(n):
                kids = [j for j in range(1, n) if parents[j] == u]
                if not kids:
                    continue
                spine, others = kids[0], kids[1:]
                assert len(others) <= 2, "at most topk - 1 chosen siblings"
                assert torch.allclose(rows[spine - 1], q[spine - 1], rtol=0, atol=1e-12)
                top = q[spine - 1].topk(len(others) + 1).indices
                want = top[top != tree.tokens[spine]][: len(others)]
                assert tree.tokens[others].tolist() == want.tolist()
                assert all(float(rows[j - 1, int(tree.tokens[j])]) == 1.0 for j in others)
    if size == "adaptive":
        assert min(sizes) < len(full), "the budget cut some tree"


def test_the_spine_lengths_on_the_device_equal_the_chain_rule():
    """BudgetPolicy.chain_fixed (a drawn tree's spine, no host read) gives what `chain` (SGLang's
    rule, tests/with_sglang) gives, round after round through the lag, with a table, online and
    forced; and the same budget (settled from the draft's read)."""
    from dsv4_tree.budget.budget_policy import BudgetPolicy
    from dsv4_tree.budget.cost_table import LineTable

    table = LineTable((1, 4), (0.01, 0.012), (0.0004, 0.0003), note="test")
    g = torch.Generator().manual_seed(13)
    for kind in ("table", "online", "forced"):
        a = BudgetPolicy(8, table if kind == "table" else None, forced_nodes=3.5 if kind == "forced" else None)
        b = BudgetPolicy(8, table if kind == "table" else None, forced_nodes=3.5 if kind == "forced" else None)
        for rnd in range(6):
            ids = [0, 1, 2, 3] if rnd % 3 else [0, 2, 5, 6]
            conf = torch.rand(4, 5, generator=g) ** 0.3
            conf[0, 2] = 1e-9  # below SURVIVAL_EPS: takes a slot, adds nothing
            want = a.chain(ALONE, ids, conf)
            got = b.chain_fixed(ALONE, ids, conf)
            b.settle(b.unsettled().tolist())
            assert torch.equal(want, got), (kind, rnd, want, got)
            assert a.last_budget == b.last_budget, (kind, rnd)
            if kind == "online":  # both learn the same line from the same timings
                for p in (a, b):
                    p.costs.add(4, int(want.sum()), 0.01 + 0.0003 * int(want.sum()) + 0.0001 * rnd)


def test_sibling_values_and_the_budgets_price():
    """node_values: a spine node at depth k is worth its survival c_1 .. c_k, a rank-j sibling
    S_(k-1) (1 - c_k) x the chance it is tried and accepted; marginal_value is the survival of
    the last spine node the chain's budget takes (+inf for none), so a sibling is kept only when
    it is worth as much."""
    from dsv4_tree.drafters.dspark_drawn import DrawnTree, node_values
    from dsv4_tree.budget.verify_budget import marginal_value, verify_lens_fixed

    counts = [2, 1]
    drawn = DrawnTree(torch.zeros(1, 6, dtype=torch.int64), drawn_parents(counts), counts,
                      torch.zeros(1, 5, V, dtype=torch.float64), torch.zeros(1, 3, dtype=torch.int64),
                      torch.zeros(1, 2, V))
    conf = torch.tensor([[0.8, 0.5]])
    rates = torch.tensor([0.5, 0.2], dtype=torch.float64)
    got = node_values(drawn, conf, rates)
    want = torch.tensor([[0.8, 0.2 * 0.5, 0.2 * 0.5 * 0.2, 0.4, 0.8 * 0.5 * 0.5]], dtype=torch.float64)
    assert torch.allclose(got, want, rtol=0, atol=1e-7)
    two = torch.tensor([[0.8, 0.5], [0.9, 0.1]])  # survivals 0.8, 0.4 | 0.9, 0.09
    assert float(marginal_value(two, 0)) == float("inf")
    assert abs(float(marginal_value(two, 2)) - 0.8) < 1e-7 and abs(float(marginal_value(two, 3)) - 0.4) < 1e-7
    assert verify_lens_fixed(two, 3).tolist() == [3, 2]  # the same three picks: 0.9, 0.8, 0.4


def test_sibling_rates_are_learnt_from_what_was_committed():
    """SiblingRate walks each drafted tree along the committed tokens: a spine match goes on, a
    sibling match counts a try and an accept for it and the ranks before it, no match counts a
    try for every sibling there."""
    from dsv4_tree.budget.sibling_rate import PRIOR, SiblingRate

    rate = SiblingRate(2)
    assert torch.allclose(rate.rates(), torch.full((2,), PRIOR, dtype=torch.float64))
    tree = dt.DraftTree.made([9, 1, 2, 3, 4, 5], drawn_parents([2, 1]))  # depth 1: 1 | 2, 3; depth 2: 4 | 5
    rate._walk(tree, [1, 5, 7])  # spine 1 accepted, then sibling 5 (rank 0) at depth 2
    rate._walk(tree, [3, 8])  # spine 1 rejected, sibling 2 rejected, sibling 3 accepted
    rate._walk(tree, [6])  # all rejected at depth 1
    rate._walk(tree, [1, 4, 0])  # the spine all the way: nothing tried
    assert rate.tries == [3, 2] and rate.accepted == [1, 1]


def _first_tokens(p, q, trials, seed, keep_siblings, keep_spine):
    """Host walks of depth-1 trees [spine x1, 2 siblings] over a depth-2 spine x2 (its child):
    keep_siblings(x1, x2) / keep_spine(x1) decide which nodes the tree holds. -> counts of the
    first emitted token."""
    g = torch.Generator().manual_seed(seed)
    probs = _targets(p, 1)[0]
    first = torch.zeros(V)
    for _ in range(trials):
        x1 = int(torch.multinomial(q[0], 1, generator=g))
        x2 = int(torch.multinomial(q[1], 1, generator=g))
        t1, r1 = _level(q[0], torch.tensor([x1]), 2)
        tokens, rows, parents = [0], [], [-1]  # as draw_tree lays them out: depth 1, then depth 2
        if keep_spine(x1):
            tokens, rows, parents = tokens + [x1], rows + [r1[0, 0]], parents + [0]
        if keep_siblings(x1, x2):
            tokens, rows, parents = tokens + t1[0, 1:].tolist(), rows + [r1[0, 1], r1[0, 2]], parents + [0, 0]
        if keep_spine(x1):
            tokens, rows, parents = tokens + [x2], rows + [q[1]], parents + [1]
        tree = dt.DraftTree(torch.tensor(tokens), torch.tensor(parents),
                            draft_probs=torch.stack(rows) if rows else torch.zeros(0, V, dtype=torch.float64))
        path, bonus = sample_drawn(tree, probs, g)
        first[tokens[path[1]] if len(path) > 1 else bonus] += 1
    return first


def test_siblings_may_follow_later_draws_a_spine_node_may_not_follow_its_own():
    """The rule behind adaptive drawn trees: siblings kept or dropped by the spine token's own
    subtree (x2, drawn after them in id order) leave the first token distributed as the target;
    a spine token kept only when it falls in a set biases it (the chi-square tells it apart)."""
    p, q = _distributions(14)
    trials = 3000
    later = _first_tokens(p, q, trials, 15, keep_siblings=lambda x1, x2: x2 % 2 == 0, keep_spine=lambda x1: True)
    assert _chi2(later, p[0]) > 1e-3, later
    favoured = int(q[0].argmax())
    biased = _first_tokens(p, q, trials, 15, keep_siblings=lambda x1, x2: True, keep_spine=lambda x1: x1 == favoured)
    assert _chi2(biased, p[0]) < 1e-6, biased


def test_drawn_rounds_stay_on_the_device():
    """The meta proxy (tests/test_device.py): drawing a level, the spine's lengths and price,
    sibling values and the batched acceptance run on device tensors without a host read or a
    host tensor mixed in (the generator's uniforms are drawn on the host and copied over)."""
    from dsv4_tree.budget.budget_policy import BudgetPolicy
    from dsv4_tree.budget.cost_table import LineTable
    from dsv4_tree.drafters.dspark_drawn import DrawnTree, _draw, _others, budget_select, draw_uniforms, node_values
    from dsv4_tree.budget.verify_budget import marginal_value
    from test_device import NoHostTensorsInDeviceOps

    b, n, m = 3, 6, "meta"
    q = torch.empty(b, V, dtype=torch.float64, device=m)
    conf = torch.empty(b, 2, device=m)
    table = LineTable((1, 4), (0.01, 0.012), (0.0004, 0.0003), note="test")
    policy = BudgetPolicy(5, table)
    with NoHostTensorsInDeviceOps():
        x = _draw(q, draw_uniforms(torch.Generator().manual_seed(0), b, 2, m)[:, 0])
        sib = _others(q, x, 2)
        lens = policy.chain_fixed(ALONE, [0, 1, 2], conf)
        price = marginal_value(conf, policy.unsettled()[0])
        drawn = DrawnTree(torch.empty(b, n, dtype=torch.int64, device=m), drawn_parents([2, 1]), [2, 1],
                          torch.empty(b, n - 1, V, dtype=torch.float64, device=m), torch.empty(b, 3, dtype=torch.int64, device=m),
                          torch.empty(b, 2, V, device=m))
        values = node_values(drawn, conf, torch.tensor([0.3, 0.2], dtype=torch.float64).to(m))
        batch, rows = budget_select(drawn, conf, lens, policy.unsettled()[0],
                                    torch.tensor([0.3, 0.2], dtype=torch.float64).to(m), torch.empty(b, dtype=torch.int64,
                                                                                              device=m))
        acc = drawn_accept(drawn.tokens, torch.tensor(PARENTS).to(m).expand(b, -1),
                           torch.empty(b, n, V, dtype=torch.float64, device=m),
                           torch.empty(b, n, V, dtype=torch.float64, device=m), torch.full((b,), n).to(m), 2, 3,
                           torch.Generator().manual_seed(1))
    assert all(t.device.type == m for t in (x, sib, lens, price, values, batch.tokens, batch.counts, rows, acc.lengths,
                                            acc.path, acc.bonus))
