"""Whole generate_batch rounds read the host a fixed number of times, the same at bs 1 and 16.

A host read (diagnostics.HostReadCounter): a scalar read, `torch.equal`, a data-dependent shape,
`Tensor.tolist` / `.numpy`; on a GPU each is a stream sync. A round may read only at the places
named in ALLOWED: the draft's one read of its trees (tree/tree_batch.py), acceptance's one read
of its result (verify/accept_batch.py: accept lengths, paths, bonus tokens); a budgeted DSpark
tree's budget and the value learner's copy of its pool ride in the draft's read. Anything else, or
a count that grows
with the batch, fails here, naming the op and the line. Three cases: the MTP tree (topk 4, 5
steps, 8 nodes), the DSpark chain (fixed) and the budgeted DSpark tree (topk 4, 16 nodes, a cost
table), greedy, fp32, on the shipped checkpoint; the two trees sampled too (acceptance on the
device: verify/accept_batch.sample_accept for the MTP tree, drawn_accept for the drawn DSpark
tree, whose spine length is set on the device, budget_policy.chain_fixed), and the sampled DSpark
chain (a drawn tree without siblings, drawn on the device)."""
from __future__ import annotations

import pytest
import torch

import dsv4_tree as dt
import dsv4_tree.generate_batch as gb
from dsv4_tree.diagnostics import HostReadCounter, OpCounter
from dsv4_tree.drafters.base import TreeShape
from dsv4_tree.budget.cost_table import LineTable
from dsv4_tree.drafters.dspark import DSparkDrafter
from dsv4_tree.train.corpus import heldout_prompt

MAX_READS = 4  # the bound per round
ALLOWED = {"tree/tree_batch.py", "verify/accept_batch.py"}  # each read once a round, in every case here
TABLE = LineTable((1, 16), (0.01, 0.012), (0.0004, 0.0003), note="a fixed price list for the test")
CASES = {  # kind, topk, num_steps, num_draft_tokens, draft_depth
    "mtp tree": ("mtp", 4, 5, 8, "fixed"),
    "dspark chain": ("dspark", 1, 5, 6, "fixed"),
    "dspark chain budgeted": ("dspark", 1, 5, 6, "adaptive"),  # SGLang's confidence-scheduled lengths
    "dspark tree budgeted": ("dspark", 4, 5, 16, "adaptive"),
}


@pytest.fixture(scope="module")
def trained():
    return dt.load_model(dt.trained_checkpoint())


def _rounds(model, case: str, bs: int, monkeypatch, temperature=None) -> list:
    """(host reads, ops) of every round that ran all bs requests."""
    kind, topk, steps, nodes, depth = CASES[case]
    spec = dt.SpecConfig(eagle_topk=topk, num_steps=steps, num_draft_tokens=nodes, draft_depth=depth, max_requests=16,
                         accept="greedy" if temperature is None else "sampling")
    engine = dt.Engine(model, spec)
    drafter = "mtp" if kind == "mtp" else DSparkDrafter(model, TreeShape.from_spec(spec), cost_table=TABLE)
    seen, real = [], gb._round

    def counted(engine, live, *args):
        with HostReadCounter(trace=True) as reads, OpCounter() as ops:
            out = real(engine, live, *args)
        if len(live) == bs:
            seen.append((reads, ops.total))
        return out

    monkeypatch.setattr(gb, "_round", counted)
    engine.generate_batch([heldout_prompt(64, s) for s in range(bs)], 8, drafter=drafter, progress=False,
                          temperature=temperature, generator=None if temperature is None else torch.Generator().manual_seed(0))
    assert len(seen) >= 2, f"{case} bs {bs}: only {len(seen)} full rounds"
    return seen


@pytest.mark.parametrize("case, temperature", [(c, None) for c in CASES] + [
    ("mtp tree", 1.0), ("dspark chain", 1.0), ("dspark tree budgeted", 1.0)])  # sampled: top-K, drawn, drawn
def test_a_round_reads_the_host_a_fixed_few_times(trained, case, temperature, monkeypatch):
    counts = {}
    ops = {}
    for bs in (1, 16):
        rounds = _rounds(trained, case, bs, monkeypatch, temperature)
        for reads, _ in rounds:
            where = {w: n for (_, w), n in reads.where.items()}
            stray = {w: n for w, n in where.items() if w.rsplit(":", 1)[0] not in ALLOWED}
            assert not stray, f"{case} bs {bs}: host reads outside {sorted(ALLOWED)}: {stray}"
            assert reads.total <= MAX_READS, f"{case} bs {bs}: {reads.total} host reads in a round: {where}"
            files = sorted(w.rsplit(":", 1)[0] for (_, w), n in reads.where.items() for _ in range(n))
            assert files == sorted(ALLOWED), f"{case} bs {bs}: want one draft read and one acceptance read: {where}"
        counts[bs] = sorted({r.total for r, _ in rounds})
        ops[bs] = sum(o for _, o in rounds) / len(rounds)
    assert counts[1] == counts[16], f"{case}: reads per round differ with the batch: {counts}"
    # the round's work is batched: ops per round barely grow with the batch (the 1.25x)
    assert ops[16] <= 1.25 * ops[1], f"{case}: {ops[16]:.0f} ops per round at bs 16 vs {ops[1]:.0f} at bs 1"


def test_the_counter_sees_each_kind_of_host_read():
    """HostReadCounter counts what a GPU would wait for, here on CPU tensors, and names the line."""
    t = torch.arange(6)
    with HostReadCounter(trace=True) as reads:
        int(t[2])
        t.tolist()
        t.numpy()
        t.nonzero()
        t[t > 2]
        torch.equal(t, t)
        torch.unique(t)
        t + 1  # not a read
    assert reads.total == 7, reads.by_reason
    assert reads.by_reason["Tensor.tolist"] == 1 and reads.by_reason["aten.nonzero"] == 1
    assert all(w == "?" for _, w in reads.where)  # no dsv4_tree frame on this stack


def test_the_adaptive_mtp_depth_reads_once_per_decision(trained, monkeypatch):
    """draft_depth="adaptive": before each further draft step the policy decides on host copies
    of the pool, the frontier and its children (drafters/mtp.py, one read per decision), so a
    round reads 2 + min(steps run, num_steps - 1) times, whatever the batch."""
    spec = dt.SpecConfig(eagle_topk=4, num_steps=5, num_draft_tokens=8, draft_depth="adaptive", max_requests=16)
    real = gb._round
    for bs in (1, 16):
        engine, seen = dt.Engine(trained, spec), []

        def counted(engine, live, drafter, *args):
            with HostReadCounter(trace=True) as reads:
                out = real(engine, live, drafter, *args)
            seen.append((reads, drafter.last_round.steps))
            return out

        monkeypatch.setattr(gb, "_round", counted)
        engine.generate_batch([heldout_prompt(64, s) for s in range(bs)], 8, drafter="mtp", progress=False)
        for reads, steps in seen:
            where = {w.rsplit(":", 1)[0] for (_, w) in reads.where}
            assert where <= ALLOWED | {"drafters/mtp.py"}, (bs, dict(reads.where))
            assert reads.total == 2 + min(steps, spec.num_steps - 1), (bs, steps, dict(reads.where))
