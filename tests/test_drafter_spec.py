"""Drafters and the engine's spec: eagle_topk is refused above the vocabulary wherever a tree
is chosen (Engine, MtpDrafter, custom_generate, the CLI), and an MtpDrafter built by hand
follows SpecConfig.draft_depth unless given its own depth (a contradiction is refused)."""
import pytest
import torch
from transformers import DeepseekV4ForCausalLM

import dsv4_tree as dt
from cases import prompt
from dsv4_tree.cli import main
from dsv4_tree.drafters import MtpDrafter, TreeShape
from test_adaptive_depth import PRESET, Clock, engine, priced, trained  # noqa: F401 (trained: a fixture)

VOCAB = 260  # the trained byte-level checkpoint: 256 bytes + specials


@pytest.fixture(scope="module")
def model():
    m = dt.load_model(dt.trained_checkpoint())
    assert m.vocab_size == VOCAB
    return m


# ---------------------------------------------------------------- eagle_topk and the vocabulary
def test_eagle_topk_above_the_vocabulary_is_refused_by_the_engine_and_the_drafter(model):
    too_many = f"eagle_topk={VOCAB + 40} exceeds the model's vocabulary size {VOCAB}"
    with pytest.raises(dt.ConfigError, match=too_many):
        dt.Engine(model, dt.SpecConfig(eagle_topk=VOCAB + 40, num_steps=2, num_draft_tokens=8))
    with pytest.raises(dt.ConfigError, match=too_many):  # num_draft_tokens unset: the topk is named first
        dt.Engine(model, dt.SpecConfig(eagle_topk=VOCAB + 40, num_steps=2))
    with pytest.raises(dt.ConfigError, match=f"TreeShape.topk={VOCAB + 1} exceeds the model's vocabulary size {VOCAB}"):
        MtpDrafter(model, TreeShape(VOCAB + 1, 2, 8))
    # the limit itself drafts: every token a child of the root
    eng = dt.Engine(model, dt.SpecConfig(eagle_topk=VOCAB, num_steps=1, num_draft_tokens=8))
    ids = prompt(30, 1) % 256
    got = eng.generate(ids, 6, drafter="mtp", progress=False)
    assert got.tokens == eng.generate(ids, 6, drafter="ngram", progress=False).tokens  # greedy either way
    assert set(got.stats.draft_steps) == {1}


def test_custom_generate_and_cli_refuse_eagle_topk_above_the_vocabulary(capsys):
    hf = DeepseekV4ForCausalLM.from_pretrained(str(dt.trained_checkpoint()), dtype=torch.float32).eval()
    ids = (prompt(20, 2) % 256).unsqueeze(0)
    with pytest.raises(dt.ConfigError, match=f"eagle_topk=300 exceeds the model's vocabulary size {VOCAB}"):
        hf.generate(ids, max_new_tokens=4, do_sample=False, custom_generate=dt.custom_generate,
                    dsv4_eagle_topk=300, dsv4_num_draft_tokens=8, dsv4_drafter="mtp")
    code = main(["generate", "--topk", "300", "--drafter", "mtp", "--max-new-tokens", "4"])
    err = capsys.readouterr().err
    assert code == 2 and "eagle_topk=300" in err and f"vocabulary size {VOCAB}" in err and "Traceback" not in err, err


# ---------------------------------------------------------------- draft_depth and a hand-built MtpDrafter
def test_a_hand_built_mtp_drafter_follows_the_engines_draft_depth(trained, monkeypatch):
    model, ids, want = trained
    # a tree engine, draft_depth unset (adaptive for trees): steps that cost 100 verifies stop
    # after step 1 from round 2 on (but for a round or so), as drafter="mtp" would
    eng, clock = engine(model), Clock()
    drafter = MtpDrafter(model, PRESET, clock=clock)
    priced(monkeypatch, eng, clock, step=lambda rows: 1.0, verify=lambda b: 0.01)
    res = eng.generate(ids, 24, drafter=drafter, progress=False)
    assert res.tokens == want[:24]
    steps = res.stats.draft_steps
    # (the first round's slow steps inflate the time per token the policy weighs a step against,
    # which may buy one round a second step)
    assert steps[0] > 1 and steps[1:].count(1) >= len(steps) - 2 and max(steps[1:]) <= 2, steps
    assert res.stats.depth is not None and res.stats.depth.rounds_observed == res.stats.rounds
    # the same drafter for an engine whose spec says fixed: every step every round, and the
    # fixed rounds leave the adaptive measurements alone
    fixed = engine(model, draft_depth="fixed")
    priced(monkeypatch, fixed, clock, step=lambda rows: 1.0, verify=lambda b: 0.01)
    observed = drafter.policy.rounds_observed
    res = fixed.generate(ids, 24, drafter=drafter, progress=False)
    assert res.tokens == want[:24] and set(res.stats.draft_steps) == {PRESET.num_steps}, res.stats.draft_steps
    assert drafter.policy.rounds_observed == observed
    # a chain engine (fixed by default) with a chain drafter: all steps
    chain = dt.Engine(model, dt.SpecConfig(num_steps=3))
    res = chain.generate(ids, 12, drafter=MtpDrafter(model, TreeShape(1, 3, 4)), progress=False)
    assert res.tokens == want[:12] and set(res.stats.draft_steps) == {3} and res.stats.depth is None


def test_a_drafters_own_depth_applies_unless_the_spec_says_otherwise(trained, monkeypatch):
    model, ids, want = trained
    eng, clock = engine(model), Clock()  # draft_depth unset: the drafter's own depth decides
    priced(monkeypatch, eng, clock, step=lambda rows: 1.0, verify=lambda b: 0.01)
    res = eng.generate(ids, 16, drafter=MtpDrafter(model, PRESET, depth="fixed"), progress=False)
    assert res.tokens == want[:16] and set(res.stats.draft_steps) == {PRESET.num_steps} and res.stats.depth is None
    for spec_depth, own in (("adaptive", "fixed"), ("fixed", "adaptive")):
        eng = engine(model, draft_depth=spec_depth)
        drafter = MtpDrafter(model, PRESET, depth=own)
        for call in (lambda: eng.generate(ids, 8, drafter=drafter, progress=False),
                     lambda: eng.generate_batch([ids, ids[:50]], 8, drafter=drafter, progress=False)):
            with pytest.raises(dt.ConfigError, match=f"MtpDrafter\\(depth='{own}'\\) .* SpecConfig.draft_depth="
                                                     f"'{spec_depth}'"):
                call()
            assert eng.runtime.pages.free_rows == eng.spec.max_requests and not drafter.caches
        # refused before any draft: nothing drafted, nothing measured (an adaptive drafter holds its policy from the start)
        assert drafter.last_round is None and (drafter.policy is None or drafter.policy.rounds_observed == 0)
        same = MtpDrafter(model, PRESET, depth=spec_depth, mtp=drafter.mtp)  # agreeing: runs
        assert eng.generate(ids, 8, drafter=same, progress=False).tokens == want[:8]
