"""A verify or prefill whose table build raises (Ctrl-C, out of memory, a failed launch) after
ServingRuntime.plan took the page-table updates: the updates are not lost, so a retry computes
what the call would have computed, for every request of it, in that round and later ones.
(Before, the retry read a page cell the device never got: a raw IndexError, or another live
request's logits off by 5e-2.)"""
from __future__ import annotations

import pytest
import torch

import dsv4_tree as dt
import dsv4_tree.serving.runtime as runtime
from cases import REL_TOL, prompt, random_tree, small_model
from dsv4_tree.reference import per_path_logits, relative_error

SPEC = dict(eagle_topk=3, num_steps=6, num_draft_tokens=12, page_size=8)


class Failure(Exception):
    pass


def fail_next_build(monkeypatch):
    real = runtime.build_step

    def once(*args, **kwargs):
        monkeypatch.setattr(runtime, "build_step", real)
        raise Failure("simulated launch failure inside the table build")

    monkeypatch.setattr(runtime, "build_step", once)


def check(model, engine, reqs, trees):
    out = engine.verify(reqs, trees)
    for b, (r, t) in enumerate(zip(reqs, trees)):
        err = relative_error(out.logits[b], per_path_logits(model, r.tokens, t))
        assert err < REL_TOL, f"request {b}: {err:.2e}"
    return out


def test_a_verify_retried_after_its_table_build_raised_computes_every_request(monkeypatch):
    model = small_model()
    engine = dt.Engine(model, dt.SpecConfig(**SPEC))
    reqs = [engine.prefill(prompt(15, 1)), engine.prefill(prompt(30, 2))]  # P = 14, 29: the trees map new pages
    trees = [random_tree(r.root_token, 12, 6, 3, b) for b, r in enumerate(reqs)]
    fail_next_build(monkeypatch)
    with pytest.raises(Failure):
        engine.verify(reqs, trees)
    out = check(model, engine, reqs, trees)
    engine.commit(reqs, engine.accept_greedy(reqs, trees, out), out)
    for rnd in range(2):  # later rounds read the pages that failed verify mapped
        check(model, engine, reqs, [random_tree(r.root_token, 12, 6, 3, 10 + rnd + b) for b, r in enumerate(reqs)])
