"""What a drafter returns is checked before anything uses it (drafters.base.check_drafted): a
list of one DraftTree per request, in order, or InputError naming the drafter and what it
returned, in generate and generate_batch alike; nothing is left behind."""
import pytest
import torch

import dsv4_tree as dt
from cases import prompt, small_model


def trees_for(requests) -> list:
    """One valid 3-node chain per request."""
    return [dt.DraftTree.chain([r.root_token, 5, 6]) for r in requests]


# each case: (what draft returns, given the requests; what the message must say)
CASES = {
    "None": (lambda reqs: None, "it returned None"),
    "one tree, no list": (lambda reqs: trees_for(reqs)[0], "it returned a DraftTree"),
    "list of lists": (lambda reqs: [[t] for t in trees_for(reqs)], r"element \[0\] of the list .* a list of length 1"),
    "a tensor": (lambda reqs: torch.tensor([r.root_token for r in reqs]), r"it returned a Tensor of shape \(\d+,\)"),
    "list of tensors": (lambda reqs: [t.tokens for t in trees_for(reqs)], r"element \[0\] .* a Tensor of shape \(3,\)"),
    "list with None": (lambda reqs: trees_for(reqs)[:-1] + [None], r"element \[\d\] .* is None"),
    "empty list": (lambda reqs: [], r"it returned 0 trees for \d requests"),
    "one too few": (lambda reqs: trees_for(reqs)[:-1] if len(reqs) > 1 else [], r"it returned \d trees for \d requests"),
    "one too many": (lambda reqs: trees_for(reqs) + trees_for(reqs)[:1], r"it returned (\d) trees for \d requests"),
    "an iterator": (lambda reqs: iter(trees_for(reqs)), "it returned a list_iterator"),
    "wrong order": (lambda reqs: [dt.DraftTree.chain([(r.root_token + 1) % 50, 5]) for r in reqs],
                    r"in the requests' order; tree \[0\] it returned has root token"),
}


class Returns:
    """A drafter returning CASES[case]'s value."""

    def __init__(self, case):
        self.make = CASES[case][0]

    def draft(self, engine, requests):
        return self.make(requests)


@pytest.fixture(scope="module")
def eng():
    return dt.Engine(small_model(), dt.SpecConfig(eagle_topk=2, num_steps=3, num_draft_tokens=6, max_requests=4))


@pytest.mark.parametrize("case", list(CASES))
def test_bad_drafter_output_is_an_input_error_naming_the_drafter(eng, case):
    match = CASES[case][1]
    prompts = [prompt(9, 1), prompt(7, 2)]
    calls = {"generate": lambda: eng.generate(prompts[0], 6, drafter=Returns(case), progress=False),
             "generate_batch": lambda: eng.generate_batch(prompts, 6, drafter=Returns(case), progress=False)}
    for where, call in calls.items():
        with pytest.raises(dt.InputError, match=match) as err:
            call()
        assert "Returns.draft(engine, requests) must return a list of one DraftTree per request" in str(err.value), \
            f"{case=} {where=}: {err.value}"
        assert eng.runtime.pages.free_rows == eng.spec.max_requests, f"{case=} {where=}: a request row was kept"


def test_a_tuple_of_trees_in_order_is_accepted(eng):
    class Tuples:
        def draft(self, engine, requests):
            return tuple(trees_for(requests))

    prompts = [prompt(9, 1), prompt(7, 2)]
    want = [eng.generate(p, 6, drafter="ngram", progress=False).tokens for p in prompts]  # greedy: any drafter
    assert eng.generate(prompts[0], 6, drafter=Tuples(), progress=False).tokens == want[0]
    assert [r.tokens for r in eng.generate_batch(prompts, 6, drafter=Tuples(), progress=False)] == want
