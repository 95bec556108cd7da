"""Stateful fuzz: random sequences of prefill, verify (valid and invalid trees), greedy and
sampling acceptance, commit, stale commits, commits with another verify's acceptances,
tampered acceptances and release, over several requests on the tiny checkpoint.

Invariants after every step: each live request's committed state equals serial decoding of
its committed tokens (a fresh request prefilled with tokens + root, within the documented
absolute 1e-5 of design_notes/tolerances.md), and every refused call raised a dsv4_tree error
and changed no request's state (bit for bit)."""
import functools
from dataclasses import dataclass

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import dsv4_tree as dt
from cases import random_tree, snapshot
from dsv4_tree.drafters import PlantedDrafter, TreeShape

STATE_TOL = 1e-5  # design_notes/tolerances.md: committed state vs serial decode
SHAPE = TreeShape(3, 4, 10)
MAX_REQUESTS = 3


@functools.lru_cache(maxsize=None)
def tiny_model():
    return dt.load_model(dt.tiny_checkpoint())


@dataclass
class Round:
    reqs: list
    trees: list
    out: dt.VerifyOutput
    accs: list | None = None


def full_state(eng, req):
    return req.seq_len, req.root_token, req.tokens.clone(), snapshot(eng, req)


def same_state(a, b, tol=0.0) -> str | None:
    """None when equal (bitwise, or within tol), else what differs."""
    if a[:2] != b[:2] or not torch.equal(a[2], b[2]):
        return f"seq_len/root/tokens {a[:2]} vs {b[:2]}"
    for li, (la, lb) in enumerate(zip(a[3], b[3])):
        if la.keys() != lb.keys():
            return f"layer {li} fields {sorted(la)} vs {sorted(lb)}"
        for k in la:
            if la[k].shape != lb[k].shape:
                return f"layer {li} {k} shape {tuple(la[k].shape)} vs {tuple(lb[k].shape)}"
            if la[k].numel() and float((la[k].double() - lb[k].double()).abs().max()) > tol:
                return f"layer {li} {k} differs by {float((la[k].double() - lb[k].double()).abs().max()):.2e}"
    return None


class EngineMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        # pools sized for this machine's few requests (page 16): hypothesis may keep every
        # example's machine alive until the test ends, and each holds its engine's pools
        self.eng = dt.Engine(tiny_model(), dt.SpecConfig(eagle_topk=SHAPE.topk, num_steps=SHAPE.num_steps,
                                                         num_draft_tokens=SHAPE.num_draft_tokens, page_size=16,
                                                         max_requests=MAX_REQUESTS + 2, prefill_chunk=64))
        self.vocab = self.eng.model.vocab_size
        self.reqs: list = []
        self.rounds: list = []
        self.checked: dict = {}  # request_id -> state already shown equal to serial decoding

    # ------------------------------------------------------------ helpers
    def stale(self, rnd: Round) -> bool:
        """Committed since, or verified again since (a request's draft slots hold only its
        latest verify's rows): commit must refuse it."""
        return (tuple(r.seq_len for r in rnd.reqs) != rnd.out.seq_lens
                or any(r.scratch_owner != rnd.out.verify_id for r in rnd.reqs))

    def refused(self, call, label):
        """`call` must raise a dsv4_tree error and leave every request bit for bit unchanged."""
        tracked = {id(r): r for r in self.reqs + [r for rnd in self.rounds for r in rnd.reqs]}
        before = {k: full_state(self.eng, r) for k, r in tracked.items()}
        try:
            call()
        except dt.Dsv4TreeError:
            pass
        else:
            raise AssertionError(f"{label}: accepted, expected a dsv4_tree error")
        for k, r in tracked.items():
            diff = same_state(full_state(self.eng, r), before[k])
            assert diff is None, f"{label}: refused call changed request {r.request_id}: {diff}"

    # ------------------------------------------------------------ rules
    @initialize(length=st.integers(1, 40), seed=st.integers(0, 2**31 - 1))
    def first_request(self, length, seed):
        self.prefill(length, seed)

    @precondition(lambda self: len(self.reqs) < MAX_REQUESTS)  # the pools hold MAX_REQUESTS + 2
    @rule(length=st.one_of(st.integers(1, 40), st.integers(124, 132)), seed=st.integers(0, 2**31 - 1))
    def prefill(self, length, seed):
        ids = torch.randint(2, self.vocab, (length,), generator=torch.Generator().manual_seed(seed))
        self.reqs.append(self.eng.prefill(ids))

    def fresh_round(self, data, with_accs: bool) -> Round:
        """A round that is not stale (verified now), accepted greedily when with_accs."""
        rnd = self.new_round(data)
        if with_accs:
            rnd.accs = self.eng.accept_greedy(rnd.reqs, rnd.trees, rnd.out)
        return rnd

    def a_round(self, data, with_accs: bool) -> Round:
        cands = [r for r in self.rounds if r.accs or not with_accs]
        return data.draw(st.sampled_from(cands)) if cands else self.fresh_round(data, with_accs)

    @rule(data=st.data())
    def verify(self, data):
        self.new_round(data)

    def new_round(self, data) -> Round:
        idx = data.draw(st.lists(st.integers(0, len(self.reqs) - 1), min_size=1, unique=True))
        reqs = [self.reqs[i] for i in idx]
        trees = []
        for req in reqs:
            if data.draw(st.integers(0, 2)) == 0:  # planted: the target's greedy path among random siblings
                seed = data.draw(st.integers(0, 1000))
                trees.append(PlantedDrafter(self.eng.model, SHAPE, corrupt=0.3, seed=seed).draft_one(req))
            else:
                n, depth = data.draw(st.integers(1, SHAPE.num_draft_tokens)), data.draw(st.integers(0, SHAPE.num_steps))
                kids, seed = data.draw(st.integers(1, SHAPE.topk)), data.draw(st.integers(0, 1000))
                trees.append(random_tree(req.root_token, n, depth, kids, seed))
        before = [full_state(self.eng, r) for r in reqs]
        out = self.eng.verify(reqs, trees)
        for r, b in zip(reqs, before):
            assert same_state(full_state(self.eng, r), b) is None, "verify changed committed state"
        self.rounds.append(Round(reqs, trees, out))
        return self.rounds[-1]

    @rule(data=st.data(), kind=st.sampled_from(["root", "nodes", "depth", "vocab", "twice", "lengths", "type"]))
    def verify_invalid(self, data, kind):
        req = data.draw(st.sampled_from(self.reqs))
        root = req.root_token
        reqs, trees = [req], [random_tree(root, 4, 2, 2, 0)]
        if kind == "root":
            trees = [random_tree((root + 1) % self.vocab, 4, 2, 2, 0)]
        elif kind == "nodes":
            trees = [random_tree(root, SHAPE.num_draft_tokens + 1, 3, 4, 1)]
        elif kind == "depth":
            trees = [dt.DraftTree.chain([root] + [5] * (SHAPE.num_steps + 1))]
        elif kind == "vocab":
            trees = [dt.DraftTree.chain([root, self.vocab + data.draw(st.integers(0, 100))])]
        elif kind == "twice":
            reqs, trees = [req, req], trees * 2
        elif kind == "lengths":
            trees = trees * 2
        else:
            trees = [[root, 5]]
        self.refused(lambda: self.eng.verify(reqs, trees), f"verify_invalid {kind}")

    @rule(data=st.data(), sampling=st.booleans(), temperature=st.sampled_from([0.5, 1.0, 2.0]))
    def accept(self, data, sampling, temperature):
        rnd = self.a_round(data, with_accs=False)

        def call():
            if sampling:
                gen = torch.Generator().manual_seed(data.draw(st.integers(0, 1000)))
                return self.eng.accept_sampling(rnd.reqs, rnd.trees, rnd.out, temperature, 1.0, gen)
            return self.eng.accept_greedy(rnd.reqs, rnd.trees, rnd.out)

        if self.stale(rnd):
            self.refused(call, "accept on a stale verify")
        else:
            rnd.accs = call()

    @rule(data=st.data())
    def commit(self, data):
        rnd = self.a_round(data, with_accs=True)
        if self.stale(rnd):
            self.refused(lambda: self.eng.commit(rnd.reqs, rnd.accs, rnd.out), "stale commit")
        else:
            self.eng.commit(rnd.reqs, rnd.accs, rnd.out)

    @rule(data=st.data())
    def commit_other_acceptances(self, data):
        a = self.a_round(data, with_accs=True)
        others = [r for r in self.rounds if r.accs and r is not a]
        b = data.draw(st.sampled_from(others)) if others else self.fresh_round(data, with_accs=True)
        self.refused(lambda: self.eng.commit(b.reqs, a.accs, b.out), "commit with another verify's acceptances")
        self.refused(lambda: self.eng.commit(a.reqs, a.accs, b.out), "commit with another verify's output")

    @rule(data=st.data(), kind=st.sampled_from(["node", "vocab", "float", "root", "count"]))
    def commit_tampered(self, data, kind):
        rnd = self.a_round(data, with_accs=True)
        b = data.draw(st.integers(0, len(rnd.accs) - 1))
        acc, n = rnd.accs[b], rnd.trees[b].num_nodes
        bad = {"node": dt.Acceptance(acc.path + (n,), acc.bonus, acc.request_id, acc.verify_id),
               "vocab": dt.Acceptance(acc.path, self.vocab, acc.request_id, acc.verify_id),
               "float": dt.Acceptance(acc.path, acc.bonus + 0.5, acc.request_id, acc.verify_id),
               "root": dt.Acceptance((1,) + acc.path[1:], acc.bonus, acc.request_id, acc.verify_id)}
        accs = list(rnd.accs)
        if kind == "count":
            accs = accs + accs[:1]
        elif kind == "root" and n == 1:
            accs[b] = dt.Acceptance((), acc.bonus, acc.request_id, acc.verify_id)
        else:
            accs[b] = bad[kind]
        self.refused(lambda: self.eng.commit(rnd.reqs, accs, rnd.out), f"tampered commit ({kind})")

    @precondition(lambda self: len(self.reqs) >= 2)  # keep one request: every other rule needs one
    @rule(data=st.data())
    def release(self, data):
        """Engine.release returns the request's slots; any later use of it is refused."""
        req = self.reqs.pop(data.draw(st.integers(0, len(self.reqs) - 1)))
        self.rounds = [r for r in self.rounds if all(x is not req for x in r.reqs)]
        self.checked.pop(req.request_id, None)
        self.eng.release(req)

    # ------------------------------------------------------------ invariant
    @invariant()
    def committed_state_is_serial_decoding(self):
        for req in self.reqs:
            now = full_state(self.eng, req)
            known = self.checked.get(req.request_id)
            if known is not None and same_state(now, known) is None:
                continue
            fresh = self.eng.prefill(torch.cat([req.tokens, torch.tensor([req.root_token])]))
            diff = same_state(now, full_state(self.eng, fresh), STATE_TOL)
            self.eng.release(fresh)
            assert diff is None, f"request {req.request_id} (P={req.seq_len}) differs from serial decoding: {diff}"
            self.checked[req.request_id] = now


EngineMachine.TestCase.settings = settings(
    max_examples=8, stateful_step_count=20, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
test_engine_state_machine = EngineMachine.TestCase
