"""Drafters by name, bad drafters, Engine.release, and drafter state freed after requests end."""
import pytest
import torch

import dsv4_tree as dt
from cases import prompt
from dsv4_tree.cli import main
from dsv4_tree.drafters import MtpDrafter, NgramDrafter, TreeShape
from test_mtp import mtp_model


def test_drafters_by_name_in_generate_and_generate_batch():
    model = mtp_model()
    eng = dt.Engine(model, dt.SpecConfig(eagle_topk=2, num_steps=3, num_draft_tokens=6))
    ids = prompt(12, 5).repeat(2)
    outs = {name: eng.generate(ids, 8, drafter=name, progress=False).tokens for name in ("mtp", "ngram", "planted")}
    assert len(set(map(tuple, outs.values()))) == 1  # greedy: the drafter never changes the output
    assert isinstance(eng.named_drafters["mtp"], MtpDrafter)
    assert isinstance(eng.named_drafters["ngram"], NgramDrafter)
    again = eng.generate_batch([ids], 8, drafter="mtp", progress=False)[0].tokens
    assert again == outs["mtp"]


@pytest.mark.parametrize("bad", ["eagle", "MTP", object(), 3, NgramDrafter])
def test_bad_drafter_is_an_input_error_naming_the_choices(bad):
    model = mtp_model()
    eng = dt.Engine(model, dt.SpecConfig(num_steps=2))
    for call in (lambda: eng.generate(prompt(5, 1), 4, drafter=bad, progress=False),
                 lambda: eng.generate_batch([prompt(5, 1)], 4, drafter=bad, progress=False)):
        with pytest.raises(dt.InputError, match=r"mtp.*ngram.*planted.*draft\(engine, requests\)"):
            call()


def test_cli_rejects_unknown_drafter(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--drafter", "eagle", "--max-new-tokens", "2"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "eagle" in err and "mtp" in err and "ngram" in err and "planted" in err


def test_many_generate_calls_leave_no_drafter_state():
    model = mtp_model()
    eng = dt.Engine(model, dt.SpecConfig(eagle_topk=2, num_steps=3, num_draft_tokens=6))
    drafter = MtpDrafter(model, TreeShape(2, 3, 6), record=True)
    for seed in range(6):
        eng.generate(prompt(8 + seed, seed), 5, drafter=drafter, progress=False)
        assert not drafter.caches and not drafter.records, f"state left after generate #{seed}"
    eng.generate_batch([prompt(6, s) for s in range(5)], [3, 7, 4, 9, 5], drafter=drafter, progress=False)
    assert not drafter.caches and not drafter.records
    with pytest.raises(RuntimeError):  # a failing round still releases the request
        eng.generate(prompt(9, 1), 5, drafter=_Failing(drafter), progress=False)
    assert not drafter.caches and not drafter.records


class _Failing:
    """Drafts once with the MTP drafter, then fails."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def draft(self, engine, requests):
        self.calls += 1
        if self.calls > 1:
            raise RuntimeError("drafter failed")
        return self.inner.draft(engine, requests)

    def release(self, req):
        self.inner.release(req)


def test_release_drops_state_and_refuses_reuse():
    model = mtp_model()
    eng = dt.Engine(model, dt.SpecConfig(eagle_topk=2, num_steps=3, num_draft_tokens=6))
    drafter = MtpDrafter(model, TreeShape(2, 3, 6))
    eng.register_drafter(drafter)
    req, other = eng.prefill(prompt(10, 1)), eng.prefill(prompt(12, 2))
    trees = drafter.draft(eng, [req, other])
    out = eng.verify([req, other], trees)
    accs = eng.accept_greedy([req, other], trees, out)
    assert set(drafter.caches) == {req.request_id, other.request_id}
    eng.release(req)
    assert req.released and set(drafter.caches) == {other.request_id}
    for call in (lambda: eng.verify([req], [trees[0]]), lambda: eng.commit([req, other], accs, out),
                 lambda: drafter.draft(eng, [req]), lambda: eng.release(req)):
        with pytest.raises(dt.StateError, match="released"):
            call()
    with pytest.raises(dt.InputError, match="Request"):
        eng.release("not a request")
    tree = drafter.draft(eng, [other])[0]  # the other request goes on
    out = eng.verify([other], [tree])
    eng.commit([other], eng.accept_greedy([other], [tree], out), out)
    assert torch.equal(other.tokens[:11], prompt(12, 2)[:11])
