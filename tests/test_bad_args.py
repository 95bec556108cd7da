"""Wrong argument types and values get a specific dsv4_tree error naming the argument, never a
raw TypeError / AttributeError / IndexError, and nothing is silently truncated or ignored."""
import pytest
import torch

import dsv4_tree as dt
from cases import engine_for, prompt, random_tree, small_model, snapshot
from dsv4_tree.drafters import TreeShape
from dsv4_tree.reference import per_path_logits


@pytest.fixture()
def setup():
    model = small_model()
    eng = engine_for(model, topk=4, steps=6, nodes=16)
    return model, eng, eng.prefill(prompt(12, 1))


def state(eng, req):
    return req.seq_len, req.root_token, req.tokens.clone(), snapshot(eng, req)


def assert_same(eng, req, before):
    seq_len, root, tokens, snap = before
    assert (req.seq_len, req.root_token) == (seq_len, root) and torch.equal(req.tokens, tokens)
    for layer_now, layer_then in zip(snapshot(eng, req), snap):
        assert layer_now.keys() == layer_then.keys()
        for k in layer_now:
            assert torch.equal(layer_now[k], layer_then[k]), k


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature="a"), "temperature must be a real number, got 'a'"),
    (dict(temperature=-1.0), "temperature must be finite and >= 0"),
    (dict(temperature=float("nan")), "temperature must be a real number"),
    (dict(temperature=0.7), "spec.accept|SpecConfig.accept='greedy'"),  # greedy spec: sampling refused
    (dict(top_p="x"), "top_p must be a real number"),
    (dict(top_p=1.5), r"top_p must lie in \(0, 1\]"),
    (dict(top_p=0.9), "SpecConfig.accept='greedy'"),
    (dict(max_new_tokens=True), "max_new_tokens must be a positive int"),
    (dict(max_new_tokens=2.0), "max_new_tokens must be a positive int"),
    (dict(eos_token_id=1.5), "eos_token_id must be an int"),
    (dict(eos_token_id=[1, "a"]), "eos_token_id must be an int"),
    (dict(generator=3), "generator must be a torch.Generator"),
    (dict(drafter=object()), "drafter must be one of .* or an object with a draft"),
])
def test_generate_arguments(setup, kwargs, match):
    _, eng, _ = setup
    args = {"max_new_tokens": 4, "progress": False, **kwargs}
    with pytest.raises(dt.InputError, match=match):
        eng.generate(prompt(10, 2), **args)


@pytest.mark.parametrize("kwargs,match", [
    (dict(eos_token_id=1.5), "eos_token_id must be an int"),
    (dict(eos_token_id=[1, "a"]), "eos_token_id must be an int"),
    (dict(generator=3), "generator must be a torch.Generator"),
])
def test_generate_batch_checks_what_generate_checks(setup, kwargs, match):
    _, eng, _ = setup
    with pytest.raises(dt.InputError, match=match):
        eng.generate_batch([prompt(10, 2), prompt(12, 3)], 4, progress=False, **kwargs)


def test_sampling_arguments(setup):
    _, eng, req = setup
    tree = random_tree(req.root_token, 6, 3, 2, 1)
    out = eng.verify([req], [tree])
    for kwargs, match in [(dict(temperature="a"), "temperature must be a real number"),
                          (dict(temperature=0.0), "temperature must be > 0"),
                          (dict(temperature=float("inf")), "temperature must be > 0 and finite"),
                          (dict(top_p=None), "top_p must be a real number"),
                          (dict(generator="seed"), "generator must be a torch.Generator")]:
        with pytest.raises(dt.InputError, match=match):
            eng.accept_sampling([req], [tree], out, **kwargs)


@pytest.mark.parametrize("field", ["topk", "num_steps", "num_draft_tokens"])
@pytest.mark.parametrize("value", ["a", 2.0, True, None])
def test_tree_shape_field_types(field, value):
    args = dict(topk=2, num_steps=3, num_draft_tokens=6)
    args[field] = value
    with pytest.raises(dt.ConfigError, match=f"TreeShape.{field} must be an int"):
        TreeShape(**args)


def test_engine_spec_must_be_a_spec_config():
    model = small_model()
    with pytest.raises(dt.ConfigError, match="spec must be a dsv4_tree.SpecConfig.*dict"):
        dt.Engine(model, {"eagle_topk": 4})


@pytest.mark.parametrize("ids,match", [
    ([1.5, 2.5], "integer token ids"),
    ([1, 2.5], "integer token ids"),
    ([True, False], "integer token ids"),
    (["a", "b"], "sequence of ints"),
    ([[1, 2], [3]], "sequence of ints"),
])
def test_list_prompts_are_not_truncated(setup, ids, match):
    _, eng, _ = setup
    with pytest.raises(dt.InputError, match=match):
        eng.prefill(ids)


def test_commit_argument_types(setup):
    _, eng, req = setup
    before = state(eng, req)
    tree = random_tree(req.root_token, 8, 4, 2, 3)
    out = eng.verify([req], [tree])
    acc = eng.accept_greedy([req], [tree], out)[0]
    bad = [
        (lambda: eng.commit(req, [acc], out), "requests and accs must be lists"),
        (lambda: eng.commit([req], acc, out), "requests and accs must be lists"),
        (lambda: eng.commit([req], [acc], "out"), "out must be the VerifyOutput"),
        (lambda: eng.commit([req], [dt.Acceptance(acc.path, 5.7, req.request_id, out.verify_id)], out),
         r"accs\[0\].bonus must be an int token id, got 5.7"),
        (lambda: eng.commit([req], [dt.Acceptance(acc.path, True, req.request_id, out.verify_id)], out),
         r"accs\[0\].bonus must be an int"),
        (lambda: eng.commit([req], [dt.Acceptance((0.0,), 5, req.request_id, out.verify_id)], out),
         r"accs\[0\].path must be a tuple of int node ids"),
        (lambda: eng.commit([req], [dt.Acceptance(0, 5, req.request_id, out.verify_id)], out),
         r"accs\[0\].path must be a tuple"),
    ]
    for call, match in bad:
        with pytest.raises(dt.InputError, match=match):
            call()
        assert_same(eng, req, before)
    eng.commit([req], [acc], out)  # the real acceptance still commits
    assert req.seq_len == before[0] + len(acc.path)


def test_per_path_logits_checks_token_ids():
    model = small_model()
    tree = dt.DraftTree.chain([3, 4])
    with pytest.raises(dt.InputError, match="committed_ids: token id 600 outside the vocabulary"):
        per_path_logits(model, [1, 600], tree)
    with pytest.raises(dt.InputError, match="tree.tokens: token id 512 outside the vocabulary"):
        per_path_logits(model, [1, 2], dt.DraftTree.chain([3, 512]))
    with pytest.raises(dt.InputError, match="committed_ids must hold integer"):
        per_path_logits(model, [1.5], tree)
    with pytest.raises(dt.InputError, match="tree must be a dsv4_tree.DraftTree"):
        per_path_logits(model, [1, 2], [3, 4])


@pytest.mark.parametrize("eos", [512, -1, [3, 10**6]])
def test_eos_outside_the_vocabulary_is_refused(setup, eos):
    _, eng, _ = setup
    with pytest.raises(dt.InputError, match="outside the vocabulary"):
        eng.generate(prompt(8, 2), 4, eos_token_id=eos, progress=False)
    with pytest.raises(dt.InputError, match="outside the vocabulary"):
        eng.generate_batch([prompt(8, 2)], 4, eos_token_id=eos, progress=False)
    assert eng.runtime.pages.free_rows == 15  # only the fixture's request holds a row


@pytest.mark.parametrize("kwargs,match", [
    (dict(device="gpu0"), "device 'gpu0'"), (dict(device=3.5), "device must be"),
    (dict(dtype=torch.int64), "floating torch.dtype"), (dict(dtype="bfloat16"), "floating torch.dtype"),
    # an index past the CUDA devices this process sees (cuda:0 without CUDA): refused before loading
    (dict(device=f"cuda:{torch.cuda.device_count()}"), r"sees \d+ cuda device\(s\).*nothing was loaded"),
])
def test_load_model_arguments(kwargs, match):
    with pytest.raises(dt.InputError, match=match):
        dt.load_model(dt.tiny_checkpoint(), **kwargs)
    with pytest.raises(dt.InputError, match=match):
        dt.load_model(small_model(), **kwargs)  # a built model is checked the same way


@pytest.mark.parametrize("name", ["ngram", "planted"])
def test_model_free_drafters_refuse_a_released_request(setup, name):
    from dsv4_tree.drafters.registry import resolve_drafter

    _, eng, _ = setup
    req = eng.prefill(prompt(10, 4))
    drafter = resolve_drafter(eng, name)
    assert drafter.draft(eng, [req])[0].tokens[0] == req.root_token
    eng.release(req)
    with pytest.raises(dt.StateError, match="released"):
        drafter.draft(eng, [req])


def test_replace_turning_a_chain_into_a_tree_needs_a_node_count():
    model = small_model()
    for spec in (dt.SpecConfig(eagle_topk=4), dt.SpecConfig().replace(eagle_topk=4)):
        assert spec.num_draft_tokens is None
        with pytest.raises(dt.ConfigError, match="num_draft_tokens must be set"):
            dt.Engine(model, spec)
    assert dt.SpecConfig().replace(num_steps=5).num_draft_tokens == 6  # a chain's count follows num_steps
    assert dt.SpecConfig(eagle_topk=4, num_draft_tokens=8).replace(eagle_topk=1).num_draft_tokens == 4
    assert dt.SpecConfig(eagle_topk=4, num_draft_tokens=8).replace(num_steps=6).num_draft_tokens == 8
    with pytest.raises(dt.ConfigError, match="no field"):
        dt.SpecConfig().replace(topk=4)
