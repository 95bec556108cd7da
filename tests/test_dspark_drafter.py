"""The DSpark drafter in the engine: captured features, draft contexts across commits (nothing
from rejected drafts), release, failures, greedy generation equal to Hugging Face's, and
lossless sampling (chi-square of the first token against the target).

Bounds: drafts against the per-request reference at relative 1e-4 (tolerances.md: packed rows
round differently from the dense reference); captured features and context rows against the
reference at absolute 1e-5 (committed state vs Hugging Face's, tolerances.md)."""
from __future__ import annotations

import pytest
from pathlib import Path

import torch

import dsv4_tree as dt
from dsv4_tree.checkpoint.dspark import DSparkSettings
from dsv4_tree.checkpoint.tiny import random_dspark
from dsv4_tree.drafters.base import TreeShape
from dsv4_tree.drafters.dspark import DSparkDrafter
from dsv4_tree.drafters.dspark_rows import context_rows
from dsv4_tree.reference import relative_error
from dsv4_tree.reference.dspark import ref_dspark_block, ref_dspark_chain, ref_target_features
from test_adaptive_depth import hf_greedy
from dsv4_tree.train.corpus import heldout_prompt
from test_adaptive_sampling import chi2_p

GAMMA = 4


@pytest.fixture(scope="module")
def model():
    return dt.load_model(dt.tiny_checkpoint())


def _module(model, gamma=GAMMA, layers=(1, 2, 3), seed=0):
    return random_dspark(model.config, DSparkSettings(gamma, 8, model.vocab_size - 5, layers), seed=seed)


def _engine(model, gamma=GAMMA, **kw):
    return dt.Engine(model, dt.SpecConfig(eagle_topk=1, num_steps=gamma, num_draft_tokens=gamma + 1, **kw))


def _drafter(model, module, record=True):
    gamma = module.block_size
    return DSparkDrafter(model, TreeShape(1, gamma, gamma + 1), module=module, record=record)


def _prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 500, (n,), generator=g).tolist()


def _check_against_reference(model, drafter, req, case):
    """The request's last draft and its context equal the reference built from its committed tokens."""
    module = drafter.module
    committed = req.tokens
    feats = ref_target_features(model, committed, module.settings.target_layer_ids)
    rec = drafter.records[req.request_id]
    base, hidden = ref_dspark_block(model, module, feats, int(rec.tokens[0]))
    logits, conf = ref_dspark_chain(module, base, hidden, rec.tokens[:-1])
    assert relative_error(rec.base, base) < 1e-4, case
    assert relative_error(rec.logits, logits) < 1e-4, case
    assert (rec.confidence - conf).abs().max() < 1e-5, case
    assert torch.equal(rec.tokens[1:], rec.logits.argmax(-1)), case  # greedy: the argmax chain
    p, w = req.seq_len, model.window
    lo = max(0, p - w)
    want = context_rows(model, module, feats[lo:], torch.arange(lo, p))
    ctx = drafter.contexts[req.request_id]
    assert ctx.seq_len == p and ctx.tables.shape == want.shape, case
    torch.testing.assert_close(ctx.tables, want, rtol=0, atol=1e-5, msg=case)


def test_engine_keeps_the_target_features_of_committed_rows(model):
    module = _module(model, layers=(0, 3))
    eng = _engine(model)
    eng.register_drafter(_drafter(model, module))
    req = eng.prefill(_prompt(50, 1))
    want = ref_target_features(model, req.tokens, (0, 3))
    assert req.new_features.shape == (model.window, 2 * model.config.hidden_size)
    torch.testing.assert_close(req.new_features, want[-model.window:], rtol=0, atol=1e-5)


def _hf_streams(model, tokens):
    """transformers' output_hidden_states over the committed tokens: [layers + 1] of [P, hc, d];
    entry i + 1 is layer i's output, entry i its input."""
    ids = torch.as_tensor(tokens, dtype=torch.int64).unsqueeze(0)
    with torch.no_grad():
        states = model.hf(input_ids=ids, use_cache=False, output_hidden_states=True).hidden_states
    return [s[0] for s in states]


def test_features_and_drafts_read_the_outputs_of_layers_0_and_2_as_transformers_gives_them(model):
    """Target layers (0, 2) of 4: not contiguous, not the last. The engine's captured features are
    transformers' hidden_states[1] and [3] (the two layers' outputs, mean over hc), and the drafts,
    over two rounds, equal the reference block built from exactly those; the inputs
    (hidden_states[0] and [2]) give other drafts, so this fails on either choice."""
    module = _module(model, layers=(0, 2))
    eng = _engine(model)
    drafter = _drafter(model, module)
    eng.register_drafter(drafter)
    req = eng.prefill(_prompt(21, 7))
    for rnd in range(2):
        states = _hf_streams(model, req.tokens)
        outputs = torch.cat([states[1].mean(1), states[3].mean(1)], -1)
        inputs = torch.cat([states[0].mean(1), states[2].mean(1)], -1)
        n = req.new_features.shape[0]
        torch.testing.assert_close(req.new_features, outputs[-n:], rtol=0, atol=1e-5)
        tree = drafter.draft(eng, [req])[0]
        rec = drafter.records[req.request_id]
        base, hidden = ref_dspark_block(model, module, outputs, req.root_token)
        logits, conf = ref_dspark_chain(module, base, hidden, rec.tokens[:-1])
        assert relative_error(rec.base, base) < 1e-4 and relative_error(rec.logits, logits) < 1e-4, rnd
        assert (rec.confidence - conf).abs().max() < 1e-5, rnd
        assert torch.equal(tree.tokens[1:], logits.argmax(-1)), rnd
        other, _ = ref_dspark_block(model, module, inputs, req.root_token)
        assert relative_error(rec.base, other) > 1e-2, f"{rnd}: the layers' inputs draft the same"
        out = eng.verify([req], [tree])
        eng.commit([req], eng.accept_greedy([req], [tree], out), out)


@pytest.mark.parametrize("lengths", [[5, 40], [3, 28]])
def test_drafts_and_contexts_equal_the_reference_across_rounds(model, lengths):
    """Several requests, contexts shorter and longer than the window (32), rounds that commit
    short and long paths: each draft and each context equals the reference from the committed
    tokens alone (so no rejected draft's row is in any context)."""
    module = _module(model)
    eng = _engine(model)
    drafter = _drafter(model, module)
    eng.register_drafter(drafter)
    reqs = eng.prefill_batch([_prompt(n, i) for i, n in enumerate(lengths)])
    for rnd in range(5):
        trees = drafter.draft(eng, reqs)
        for req in reqs:
            _check_against_reference(model, drafter, req, f"{lengths=} {rnd=} P={req.seq_len}")
        out = eng.verify(reqs, trees)
        accs = eng.accept_greedy(reqs, trees, out)
        if rnd % 2:  # commit the whole drafted chain, rejected drafts included: a long path
            accs = [dt.Acceptance(tuple(range(t.num_nodes)), 3, r.request_id, out.verify_id) for t, r in zip(trees, reqs)]
        eng.commit(reqs, accs, out)
    assert max(r.seq_len for r in reqs) > model.window


def test_release_frees_the_context_and_a_dropped_request_leaves_nothing(model):
    eng = _engine(model)
    drafter = _drafter(model, _module(model))
    eng.register_drafter(drafter)
    a, b = eng.prefill(_prompt(9, 2)), eng.prefill(_prompt(12, 3))
    drafter.draft(eng, [a, b])
    assert set(drafter.contexts) == {a.request_id, b.request_id}
    eng.release(a)
    assert set(drafter.contexts) == {b.request_id} and a.request_id not in drafter.records
    with pytest.raises(dt.StateError, match="released"):
        drafter.draft(eng, [a])
    rid = b.request_id
    del b
    import gc

    gc.collect()
    assert rid not in drafter.contexts


def test_a_failure_mid_draft_or_mid_commit_leaves_the_context(model, monkeypatch):
    import dsv4_tree.drafters.dspark as dspark_module

    eng = _engine(model)
    drafter = _drafter(model, _module(model))
    eng.register_drafter(drafter)
    req = eng.prefill(_prompt(20, 4))
    trees = drafter.draft(eng, [req])
    out = eng.verify([req], trees)
    eng.commit([req], eng.accept_greedy([req], trees, out), out)
    before = drafter.contexts[req.request_id]
    tables, n = before.tables.clone(), before.seq_len

    def boom(*a, **k):
        raise RuntimeError("injected")

    with monkeypatch.context() as m:  # the draft brings the context up, then fails in the backbone
        m.setattr(dspark_module, "padded_block", boom)
        with pytest.raises(RuntimeError, match="injected"):
            drafter.draft(eng, [req])
    ctx = drafter.contexts[req.request_id]
    assert ctx.seq_len == n and torch.equal(ctx.tables, tables)
    trees = drafter.draft(eng, [req])
    out = eng.verify([req], trees)
    accs = eng.accept_greedy([req], trees, out)
    with monkeypatch.context() as m:  # the commit fails after its moves: the request keeps its state
        m.setattr(eng.runtime.pages, "shrink", boom)
        with pytest.raises(RuntimeError, match="injected"):
            eng.commit([req], accs, out)
    trees = drafter.draft(eng, [req])
    _check_against_reference(model, drafter, req, "after a failed commit")


def test_greedy_generation_equals_hugging_face(model):
    eng = _engine(model)
    drafter = _drafter(model, _module(model), record=False)
    prompt = _prompt(30, 5)
    res = eng.generate(prompt, 24, drafter=drafter, progress=False)
    assert res.tokens == hf_greedy(model, prompt, 24)
    prompts = [_prompt(n, 10 + n) for n in (7, 30, 12)]
    queued = _engine(model, max_requests=2)  # three prompts queue for two rows
    outs = queued.generate_batch(prompts, [10, 16, 6], drafter=_drafter(model, drafter.module, record=False),
                                 progress=False)
    for p, o, n in zip(prompts, outs, (10, 16, 6)):
        assert o.tokens == hf_greedy(model, p, n)


def test_greedy_generation_near_the_position_limit_and_at_eos(model):
    check_limit_and_eos(model, _engine(model), _drafter(model, _module(model), record=False))


def check_limit_and_eos(model, eng, drafter) -> None:
    """Greedy generation with `drafter` equals Hugging Face's 9 positions before the model's limit,
    and stops at an EOS met at the 10th token."""
    limit = eng.limits.max_positions
    prompt = _prompt(limit - 9, 6)
    res = eng.generate(prompt, 8, drafter=drafter, progress=False)
    assert res.tokens == hf_greedy(model, prompt, 8)
    full = hf_greedy(model, _prompt(20, 7), 16)
    eos = full[9]
    res = eng.generate(_prompt(20, 7), 16, drafter=drafter, eos_token_id=eos, progress=False)
    assert res.tokens == full[: full.index(eos) + 1] and res.stop_reason == "eos"


def test_sampled_first_tokens_follow_the_target(model):
    """Drafts are drawn from the Markov-biased draft distribution and verified by speculative
    sampling against it: the first emitted token must follow the target exactly (it would follow
    the draft distribution if drafts were always accepted, and the target's mode under greedy)."""
    trained = dt.load_model(dt.trained_checkpoint())
    module = random_dspark(trained.config, DSparkSettings(GAMMA, 8, 258, (1, 2, 3)), seed=1)
    eng = dt.Engine(trained, dt.SpecConfig(eagle_topk=1, num_steps=GAMMA, num_draft_tokens=GAMMA + 1,
                                           max_requests=64, accept="sampling"))
    drafter = _drafter(trained, module, record=False)
    eng.register_drafter(drafter)
    g = torch.Generator().manual_seed(0)
    drafter.set_sampling(1.0, 1.0, g)
    prompt = heldout_prompt(40, 3)
    reqs = eng.prefill_batch([prompt] * 64)
    target = dt.verify.sampling.target_probs(eng.verify(reqs[:1], [dt.DraftTree.chain([reqs[0].root_token])]).logits[0][0], 1.0)
    counts = torch.zeros(trained.vocab_size)
    drafted_first = torch.zeros(trained.vocab_size)
    for _ in range(40):
        trees = drafter.draft(eng, reqs)
        out = eng.verify(reqs, trees)
        for tree, acc in zip(trees, eng.accept_sampling(reqs, trees, out, 1.0, 1.0, g)):
            counts[int(tree.tokens[1]) if len(acc.path) > 1 else acc.bonus] += 1
            drafted_first[int(tree.tokens[1])] += 1
    assert chi2_p(counts, target) > 1e-3
    assert chi2_p(drafted_first, target) < 1e-6, "the draft distribution must differ from the target for this test to bite"


def test_custom_generate_drafts_with_the_shipped_dspark_by_default():
    from transformers import DeepseekV4ForCausalLM

    hf = DeepseekV4ForCausalLM.from_pretrained(str(dt.trained_checkpoint()), dtype=torch.float32).eval()
    ids = torch.tensor([heldout_prompt(80, 2)])
    want = hf.generate(ids, max_new_tokens=24, do_sample=False)
    assert torch.equal(hf.generate(ids, max_new_tokens=24, do_sample=False, custom_generate=dt.custom_generate), want)
    specs = {(k[0].eagle_topk, k[0].num_steps, k[0].num_draft_tokens) for k in hf.__dict__["_dsv4_tree_engines"]}
    assert specs == {(1, 5, 6)}, "the shipped DSpark module's chain (gamma = 5)"
    with pytest.raises(dt.ConfigError, match=r"dsv4_eagle_topk=1, dsv4_num_steps=3, dsv4_num_draft_tokens=None: .*"
                       r"num_steps=3 \(needs 5\)"):
        hf.generate(ids, max_new_tokens=4, custom_generate=dt.custom_generate, dsv4_num_steps=3)
    tree = hf.generate(ids, max_new_tokens=24, do_sample=False, custom_generate=dt.custom_generate,
                       dsv4_drafter="mtp", dsv4_eagle_topk=4, dsv4_num_steps=2, dsv4_num_draft_tokens=8)
    assert torch.equal(tree, want)
    # a tree shape with DSpark drafts its Markov tree (docs/custom-generate.md says so)
    dspark_tree = hf.generate(ids, max_new_tokens=24, do_sample=False, custom_generate=dt.custom_generate,
                              dsv4_eagle_topk=4)
    assert torch.equal(dspark_tree, want)
    engines = hf.__dict__["_dsv4_tree_engines"]
    trees = [e for k, e in engines.items() if (k[0].eagle_topk, k[0].num_steps) == (4, 5)]
    assert len(trees) == 1 and type(trees[0].named_drafters["dspark"]).__name__ == "DSparkDrafter"
    doc = (Path(__file__).parents[1] / "docs" / "custom-generate.md").read_text()
    assert "a tree shape with it is refused" not in doc and "Markov tree" in doc


def test_sampled_drafts_carry_the_reference_distributions_along_their_tokens(model):
    """In a sampling run each drafted token is drawn from softmax((U_k + W2 W1[x_{k-1}]) / T) with
    x_{k-1} the token actually drawn before it; the chain carries exactly those rows."""
    module = _module(model)
    eng = _engine(model, accept="sampling")
    drafter = _drafter(model, module)
    eng.register_drafter(drafter)
    reqs = eng.prefill_batch([_prompt(30, 8), _prompt(12, 9)])
    drafter.set_sampling(0.8, 0.95, torch.Generator().manual_seed(4))
    trees = drafter.draft(eng, reqs)
    for req, tree in zip(reqs, trees):
        feats = ref_target_features(model, req.tokens, module.settings.target_layer_ids)
        base, hidden = ref_dspark_block(model, module, feats, req.root_token)
        logits, _ = ref_dspark_chain(module, base, hidden, tree.tokens[:-1])
        want = dt.verify.sampling.target_probs(logits, 0.8, 0.95)
        assert tree.draft_probs is not None and tree.draft_probs.shape == want.shape
        torch.testing.assert_close(tree.draft_probs, want, rtol=0, atol=1e-5)  # fp32 logits, 1e-4 relative
        assert bool((tree.draft_probs.gather(1, tree.tokens[1:, None]) > 0).all())
    outs = eng.generate_batch([_prompt(20, 10), _prompt(9, 11)], 8, drafter=drafter, temperature=0.8,
                              generator=torch.Generator().manual_seed(5), progress=False)
    assert [len(o.tokens) for o in outs] == [8, 8]
    assert drafter.sampling is not None and drafter.sampling[0] == 0.8, "generate_batch tells the drafter it samples"
    _engine(model).generate_batch([_prompt(10, 12)], 4, drafter=drafter, progress=False)
    assert drafter.sampling is None, "a greedy run drafts the argmax chain again"


def test_a_drafter_that_does_not_fit_is_refused_by_name(model):
    module = _module(model)
    with pytest.raises(dt.ConfigError, match=r"num_steps=3 \(needs 4\)"):
        DSparkDrafter(model, TreeShape(1, GAMMA - 1, GAMMA), module=module)
    with pytest.raises(dt.ConfigError, match=r"at most dspark_block_size=4 deep: num_steps=5 \(needs <= 4\)"):
        DSparkDrafter(model, TreeShape(2, GAMMA + 1, 8), module=module)
    with pytest.raises(dt.ConfigError, match=r"offers 14 candidates \(needs num_draft_tokens <= 15\)"):
        DSparkDrafter(model, TreeShape(2, GAMMA, 16), module=module)
    with pytest.raises(dt.ConfigError, match="TreeShape.topk"):
        DSparkDrafter(model, TreeShape(model.vocab_size + 1, 1, 4), module=module)
    with pytest.raises(dt.ConfigError, match="size must be one of"):
        DSparkDrafter(model, TreeShape(2, GAMMA, 8), module=module, size="big")
    with pytest.raises(dt.ConfigError, match="branching must be one of"):
        DSparkDrafter(model, TreeShape(2, GAMMA, 8), module=module, branching="dd")
    with pytest.raises(dt.InputError, match="shape must be a dsv4_tree.drafters.TreeShape"):
        DSparkDrafter(model, (1, GAMMA, GAMMA + 1), module=module)
    with pytest.raises(dt.InputError, match="module is torch.float64"):
        _drafter(model, _module(model).double())
    wrong = random_dspark(model.config, DSparkSettings(GAMMA, 8, model.vocab_size - 5, (1, 2)))
    wrong.main_proj = torch.nn.Linear(3 * model.config.hidden_size, model.config.hidden_size, bias=False)
    with pytest.raises(dt.InputError, match=r"main_proj.weight has shape \(64, 192\), this target needs \(64, 128\)"):
        _drafter(model, wrong)
    drafter = _drafter(model, module)
    tree_engine = dt.Engine(model, dt.SpecConfig(eagle_topk=2, num_steps=GAMMA, num_draft_tokens=8))
    tree_engine.register_drafter(drafter)
    req = tree_engine.prefill(_prompt(10, 13))
    with pytest.raises(dt.ConfigError, match=r"drafts TreeShape\(topk=1, num_steps=4, num_draft_tokens=5\); the "
                       r"engine's SpecConfig asks for TreeShape\(topk=2"):
        drafter.draft(tree_engine, [req])
    chain_engine = dt.Engine(model, dt.SpecConfig(eagle_topk=1, num_steps=GAMMA - 1, num_draft_tokens=GAMMA))
    chain_engine.register_drafter(drafter)
    with pytest.raises(dt.ConfigError, match=r"num_steps=3 \(needs 4\)"):
        drafter.draft(chain_engine, [chain_engine.prefill(_prompt(10, 15))])
    other = dt.Engine(dt.load_model(dt.tiny_checkpoint()), dt.SpecConfig(eagle_topk=1, num_steps=GAMMA,
                                                                            num_draft_tokens=GAMMA + 1))
    with pytest.raises(dt.InputError, match="built for another model"):
        drafter.draft(other, [other.prefill(_prompt(10, 14))])
    with pytest.raises(dt.InputError, match="non-empty list of Requests"):
        drafter.draft(_engine(model), [])


def test_register_drafter_checks_the_feature_layers_before_keeping_anything(model):
    class Reads:
        def __init__(self, layers):
            self.feature_layers = layers

        def draft(self, engine, requests):
            return []

        def release(self, req):
            pass

    eng = _engine(model)
    bad = Reads((1, 9))
    with pytest.raises(dt.ConfigError, match=r"feature_layers \[1, 9\] must be distinct target layers in \[0, 4\)"):
        eng.register_drafter(bad)
    assert eng.feature_layers == () and bad not in eng._drafters
    first = Reads((1, 2))
    eng.register_drafter(first)
    other = Reads((0,))
    with pytest.raises(dt.ConfigError, match="needs an engine of its own"):
        eng.register_drafter(other)
    assert eng.feature_layers == (1, 2) and other not in eng._drafters


def test_the_cli_drafts_with_the_shipped_dspark(capsys):
    from dsv4_tree.cli import main

    assert main(["demo", "--drafter", "dspark", "--rounds", "3", "--prompt-len", "60"]) == 0
    out = capsys.readouterr().out
    assert "topk=1 num_steps=5 num_draft_tokens=6" in out and "PASS" in out
    assert main(["generate", "--drafter", "dspark", "--max-new-tokens", "12", "--prompt-len", "40"]) == 0
    assert main(["generate", "--drafter", "dspark", "--topk", "4", "--max-new-tokens", "4"]) == 0  # its tree
    capsys.readouterr()
    assert main(["generate", "--drafter", "dspark", "--num-steps", "3", "--max-new-tokens", "4"]) == 2
    assert "drafts a chain of dspark_block_size=5 tokens" in capsys.readouterr().err
    assert main(["generate", "--drafter", "dspark", "--topk", "4", "--num-steps", "6", "--max-new-tokens", "4"]) == 2
    assert "at most dspark_block_size=5 deep" in capsys.readouterr().err


def test_meta_proxy_features_and_the_dspark_pass_stay_on_device():
    """On the meta device (shapes only; a host read of device data or a host tensor in a device op
    raises): prefill and verify keep the features on the device, commit keeps them there, and
    the context bring-up, backbone pass and Markov / confidence heads run without a host read
    (the drafted tokens' host copy for the trees is the drafter's one synchronisation point)."""
    from dsv4_tree.drafters.dspark_cache import DSparkContext, bring_up, pack_contexts
    from dsv4_tree.drafters.dspark_graphs import padded_block
    from dsv4_tree.drafters.dspark_rows import confidences, markov_logits
    from test_device import NoHostTensorsInDeviceOps, host_acceptance

    model = dt.load_model(dt.tiny_checkpoint())
    model.hf.set_experts_implementation("batched_mm")  # before the stages copy the config
    module = _module(model)
    drafter = _drafter(model, module, record=False)
    model.hf.to("meta")
    module.to("meta")
    eng = _engine(model)
    eng.register_drafter(drafter)
    with NoHostTensorsInDeviceOps():
        reqs = eng.prefill_batch([_prompt(40, 20), _prompt(9, 21)])
        assert all(r.new_features.device.type == "meta" for r in reqs)
        contexts = [DSparkContext.empty(model, module) for _ in reqs]
        for rnd in range(2):  # the pass after prefill, then after a commit
            bring_up(model, module, contexts, reqs)
            tables, lengths = pack_contexts(contexts, model.window)
            anchors = torch.tensor([r.root_token for r in reqs], device=model.device)
            blk = padded_block(model, module, anchors, torch.tensor([r.seq_len for r in reqs], device=model.device),
                               tables, torch.tensor(lengths, device=model.device), model.window)
            logits = markov_logits(module, blk.base[:, 0], anchors)
            conf = confidences(module, blk.hidden[:, 0], anchors)
            trees = [dt.DraftTree.chain([r.root_token, 3, 4]) for r in reqs]
            out = eng.verify(reqs, trees)
            assert out.run.features.device.type == "meta"
            eng.commit(reqs, [host_acceptance(r, t, out, 2, 5) for r, t in zip(reqs, trees)], out)
            # the rows this commit added: the accepted path (root and 2 drafts)
            assert all(r.new_features.device.type == "meta" and r.new_features.shape[0] == 3 for r in reqs)
    assert all(c.tables.device.type == "meta" for c in contexts)
    assert logits.device.type == conf.device.type == "meta" and tuple(logits.shape) == (2, model.vocab_size)
