"""Grammar-guided requests on a server that drafts DSpark trees: refused one by one, at admission.

The tree step (`dspark_step.py`) drafts and accepts trees for the whole batch with no per-row
vocabulary mask, so it cannot honour a request's grammar; SGLang applies grammars to DSpark
chains through the draft graph's folded proposal and its grammar barrier, which the tree step
does not run. Rather than refusing the server's grammar backend at launch (users launch with
SGLang's default, xgrammar, and add grammars per request), a request carrying a grammar
(`json_schema`, `regex`, `ebnf`, `structural_tag`) finishes at admission with SGLang's own abort
(`Req.set_finish_with_abort`, the path SGLang takes for a grammar on a server launched with
`--grammar-backend none`) and a message naming why; every other request, and every server that
does not draft DSpark trees, goes through SGLang's own `process_req_with_grammar` unchanged."""
from __future__ import annotations

GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")  # SGLang's SamplingParams fields
REFUSAL = ("Grammar-based generation ({fields}) is not supported with DSpark trees (--speculative-algorithm "
           "DSPARK --speculative-eagle-topk {topk}): the tree step drafts and accepts without a per-request "
           "vocabulary mask. Send it to a server drafting DSpark chains (--speculative-eagle-topk 1).")


def grammar_fields(sampling_params) -> tuple:
    """The grammar fields a request's SamplingParams sets."""
    return tuple(f for f in GRAMMAR_FIELDS if getattr(sampling_params, f, None) is not None)


def around_process_req_with_grammar(original, manager, req) -> bool:
    """GrammarManager.process_req_with_grammar: whether the request waits in the grammar queue
    (False: the scheduler queues it, here finished with the abort)."""
    fields = grammar_fields(req.sampling_params)
    if fields:
        from .dspark_runtime import dspark_tree_spec

        tree = dspark_tree_spec()
        if tree is not None:
            req.set_finish_with_abort(REFUSAL.format(fields=", ".join(fields), topk=tree.topk))
            return False
    return original(manager, req)
