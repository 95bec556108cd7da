"""Grammar on a DSpark-tree server (sglang_plugin/grammar.py): the launch keeps SGLang's default
grammar backend; a request that carries a grammar, in SGLang's own per-request fields
(SamplingParams json_schema / regex / ebnf / structural_tag), is finished at admission with
SGLang's abort and a message naming why; requests without one, and every server that does not
draft DSpark trees, go through SGLang's own GrammarManager.process_req_with_grammar."""
from __future__ import annotations

import pytest
from sglang.srt.constrained.grammar_manager import GrammarManager
from sglang.srt.sampling.sampling_params import SamplingParams

from dsv4_tree.sglang_plugin import HOOK_TARGETS, dspark_runtime
from dsv4_tree.sglang_plugin.dspark_runtime import DSparkTreeSpec
from dsv4_tree.sglang_plugin.grammar import around_process_req_with_grammar

pytestmark = pytest.mark.sglang


class _Req:
    """What process_req_with_grammar reads of a scheduler Req, and SGLang's abort entry point."""

    def __init__(self, **grammar):
        self.sampling_params = SamplingParams(**grammar)
        self.aborted = None

    def set_finish_with_abort(self, error_msg, *args, **kwargs):
        self.aborted = error_msg


def _original_calls():
    calls = []

    def original(manager, req):
        calls.append(req)
        return "sglang's answer"

    return calls, original


GRAMMARS = [dict(json_schema='{"type": "object"}'), dict(regex="[a-z]+"), dict(ebnf='root ::= "a"'),
            dict(structural_tag='{"structures": []}')]


def test_the_hook_wraps_sglangs_grammar_admission():
    assert "sglang.srt.constrained.grammar_manager.GrammarManager.process_req_with_grammar" in HOOK_TARGETS
    assert callable(GrammarManager.process_req_with_grammar)


@pytest.mark.parametrize("grammar", GRAMMARS, ids=lambda g: next(iter(g)))
def test_a_grammar_request_on_a_dspark_tree_server_finishes_at_admission(grammar, monkeypatch):
    monkeypatch.setattr(dspark_runtime, "dspark_tree_spec", lambda: DSparkTreeSpec(4, 5, 16))
    calls, original = _original_calls()
    req = _Req(**grammar)
    assert around_process_req_with_grammar(original, object(), req) is False  # queued, finished
    assert calls == [] and req.aborted is not None
    assert next(iter(grammar)) in req.aborted and "DSpark trees" in req.aborted and "topk 4" in req.aborted


def test_requests_without_grammar_and_other_servers_go_through_sglang(monkeypatch):
    monkeypatch.setattr(dspark_runtime, "dspark_tree_spec", lambda: DSparkTreeSpec(4, 5, 16))
    calls, original = _original_calls()
    plain = _Req()
    assert around_process_req_with_grammar(original, "manager", plain) == "sglang's answer"
    assert calls == [plain] and plain.aborted is None
    monkeypatch.setattr(dspark_runtime, "dspark_tree_spec", lambda: None)  # chains, EAGLE, other models
    for grammar in GRAMMARS:
        req = _Req(**grammar)
        assert around_process_req_with_grammar(original, "manager", req) == "sglang's answer"
        assert req.aborted is None
    assert len(calls) == 1 + len(GRAMMARS)
