"""dsv4_tree.custom_generate inside transformers' own model.generate: greedy output equal to
model.generate's, left-padded batches, EOS, streamer, return_dict, refusals."""
import functools

import pytest
import torch
from transformers import DeepseekV4ForCausalLM, LogitsProcessor, LogitsProcessorList, StoppingCriteria
from transformers.generation import GenerateDecoderOnlyOutput

import dsv4_tree as dt
from dsv4_tree.hf_generate.engines import ENGINES_ATTR
from dsv4_tree.train.corpus import heldout_prompt

NEW = 16


def hf_model(which: str) -> DeepseekV4ForCausalLM:
    """A plain from_pretrained model, fp32 (transformers' default dtype for these bf16 files
    would be bf16, where two correct implementations differ by rounding). The weights load once
    per process; the engines custom_generate keeps on the model (model.__dict__[ENGINES_ATTR])
    are dropped on every call, so a test sees only the engines its own calls made, whatever ran
    before it in the process."""
    model = _loaded(which)
    model.__dict__.pop(ENGINES_ATTR, None)
    return model


@functools.lru_cache(maxsize=None)
def _loaded(which: str) -> DeepseekV4ForCausalLM:
    path = dt.trained_checkpoint() if which == "trained" else dt.tiny_checkpoint()
    return DeepseekV4ForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def prompts_for(which: str) -> list:
    if which == "trained":
        return [heldout_prompt(n, s) for n, s in ((40, 2), (72, 3), (57, 4))]
    g = torch.Generator().manual_seed(3)
    base = [torch.randint(2, 512, (n,), generator=g).tolist() for n in (9, 14, 6)]
    return [b * 3 for b in base]  # repetitive, so the n-gram drafter finds continuations


def hf_alone(model, prompt, max_new_tokens=NEW, eos_token_id=None) -> list:
    """transformers' own greedy generate on the unpadded prompt: the new tokens (cached)."""
    return list(_hf_alone(model, tuple(prompt), max_new_tokens, None if eos_token_id is None else tuple(eos_token_id)))


@functools.lru_cache(maxsize=None)
def _hf_alone(model, prompt, max_new_tokens, eos) -> tuple:
    eos = None if eos is None else list(eos)
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos)
    return tuple(out[0, len(prompt):].tolist())


def left_padded(prompts, pad: int):
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


CASES = [("trained", None), ("tiny", None), ("tiny", "ngram")]


@pytest.mark.parametrize("which,drafter", CASES)
def test_greedy_single_prompt_equals_model_generate(which, drafter):
    model = hf_model(which)
    for p in prompts_for(which)[:2]:
        ids = torch.tensor([p])
        want = model.generate(ids, max_new_tokens=NEW, do_sample=False)
        got = model.generate(ids, max_new_tokens=NEW, do_sample=False, custom_generate=dt.custom_generate,
                             dsv4_drafter=drafter)
        assert torch.equal(got, want), f"{which=} {drafter=} len={len(p)}"


@pytest.mark.parametrize("which,drafter", CASES)
def test_greedy_eos_hits_equal_model_generate(which, drafter):
    """EOS taken from transformers' own output (so it is hit), one id and several."""
    model = hf_model(which)
    p = prompts_for(which)[0]
    free = hf_alone(model, p)
    for eos in ([free[7]], [free[11], free[4]]):
        ids = torch.tensor([p])
        want = model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=eos)
        assert want.shape[1] < len(p) + NEW, f"EOS {eos} not hit: the case tests nothing"
        got = model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=eos,
                             custom_generate=dt.custom_generate, dsv4_drafter=drafter)
        assert torch.equal(got, want), f"{which=} {drafter=} {eos=}"


@pytest.mark.parametrize("which,drafter", CASES)
def test_left_padded_batch_rows_equal_their_own_runs(which, drafter):
    """Under max_new_tokens each row equals transformers' greedy run of its unpadded prompt;
    rows finishing at an EOS are padded with pad_token_id; the prompts come back as given.
    (transformers' own padded batch is not the reference: on the trained checkpoint its row
    with 15 pads here differs from that prompt's unpadded run.)"""
    model = hf_model(which)
    prompts = prompts_for(which)
    ids, mask = left_padded(prompts, pad=0)
    width = ids.shape[1]
    for eos in (None, [hf_alone(model, prompts[1])[6]]):
        got = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=eos,
                             pad_token_id=5, custom_generate=dt.custom_generate, dsv4_drafter=drafter)
        wants = [hf_alone(model, p, max_new_tokens=NEW, eos_token_id=eos) for p in prompts]
        assert got.shape == (len(prompts), width + max(map(len, wants))), f"{eos=}"
        assert torch.equal(got[:, :width], ids)
        for b, want in enumerate(wants):
            row = got[b, width:].tolist()
            assert row == want + [5] * (len(row) - len(want)), f"{which=} {drafter=} {eos=} row {b}"
        if eos is not None:
            assert len(set(map(len, wants))) > 1, "rows should finish at different lengths"


def test_left_padded_lengths_count_the_padded_width():
    """min_length and max_length count input_ids.shape[-1], the padded width, in transformers'
    loop, and so here: each row equals transformers' own padded row, and its unpadded run only
    with those limits lowered by the row's padding. With the same min_length the unpadded run
    of the row with 32 pads is another row (it stops after 44 tokens, not 7)."""
    model = hf_model("trained")
    prompts = prompts_for("trained")[:2]  # 40 and 72 bytes
    ids, mask = left_padded(prompts, pad=0)
    width = ids.shape[1]
    space = 32  # frequent in both rows' continuations: an EOS that min_length has to hold back
    held = dict(min_length=width + 6, max_new_tokens=48, eos_token_id=[space])
    for limits in (held, dict(max_length=width + 10)):
        kw = dict(do_sample=False, pad_token_id=5, **limits)
        got = model.generate(ids, attention_mask=mask, custom_generate=dt.custom_generate, **kw)
        want = model.generate(ids, attention_mask=mask, **kw)
        assert torch.equal(got, want), f"{limits=}: transformers' own padded batch"
        for b, p in enumerate(prompts):
            pad = width - len(p)
            lowered = {k: v - pad if k in ("min_length", "max_length") else v for k, v in kw.items()}
            alone = model.generate(torch.tensor([p]), **lowered)[0, len(p):].tolist()
            row = got[b, width:].tolist()
            assert row == alone + [5] * (len(row) - len(alone)), f"{limits=} row {b} {pad=}"
        if limits is held:
            short = got[0, width:].tolist()
    short = short[: short.index(space) + 1]
    same = model.generate(torch.tensor([prompts[0]]), do_sample=False, **held)[0, len(prompts[0]):].tolist()
    assert len(same) > len(short) and same[: len(short)] != short, f"{short=} {same=}"


def test_min_new_tokens_and_max_length():
    model = hf_model("trained")
    p = prompts_for("trained")[0]
    eos = [hf_alone(model, p)[2]]
    ids = torch.tensor([p])
    for kw in (dict(min_new_tokens=9, max_new_tokens=NEW), dict(max_length=len(p) + 11),
               dict(min_length=len(p) + 6, max_new_tokens=NEW)):
        want = model.generate(ids, do_sample=False, eos_token_id=eos, **kw)
        got = model.generate(ids, do_sample=False, eos_token_id=eos, custom_generate=dt.custom_generate, **kw)
        assert torch.equal(got, want), f"{kw=}"
    short = model.generate(ids, do_sample=False, eos_token_id=eos, max_new_tokens=NEW)
    assert short.shape[1] == len(p) + 3, "without min_new_tokens the EOS ends the run early"


class Recorder:
    def __init__(self):
        self.puts, self.ends = [], 0

    def put(self, value):
        self.puts.append(value.clone())

    def end(self):
        self.ends += 1


def test_streamer_gets_every_token_once_in_order():
    model = hf_model("trained")
    p = prompts_for("trained")[1]
    ids = torch.tensor([p])
    theirs, ours = Recorder(), Recorder()
    want = model.generate(ids, max_new_tokens=NEW, do_sample=False, streamer=theirs)
    got = model.generate(ids, max_new_tokens=NEW, do_sample=False, streamer=ours, custom_generate=dt.custom_generate)
    assert torch.equal(got, want)
    assert ours.ends == 1 and len(ours.puts) == len(theirs.puts) == 1 + NEW
    for a, b in zip(ours.puts, theirs.puts):  # the prompt, then one [1] tensor per token
        assert torch.equal(a, b) and a.shape == b.shape


def test_streamer_batch_columns():
    model = hf_model("trained")
    prompts = prompts_for("trained")
    ids, mask = left_padded(prompts, pad=0)
    eos = [hf_alone(model, prompts[0])[5]]
    rec = Recorder()
    got = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=eos,
                         pad_token_id=7, streamer=rec, custom_generate=dt.custom_generate)
    assert rec.ends == 1 and torch.equal(rec.puts[0], ids)
    cols = torch.stack(rec.puts[1:], dim=1)
    assert torch.equal(cols, got[:, ids.shape[1]:]), "the streamed columns are the returned new tokens"


def test_return_dict_in_generate():
    model = hf_model("tiny")
    prompts = prompts_for("tiny")
    ids, mask = left_padded(prompts, pad=0)
    plain = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, custom_generate=dt.custom_generate)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, custom_generate=dt.custom_generate,
                         return_dict_in_generate=True)
    assert isinstance(out, GenerateDecoderOnlyOutput)
    assert torch.equal(out.sequences, plain) and out.sequences.shape == (3, ids.shape[1] + NEW)
    assert out.scores is None and out.logits is None and out.past_key_values is None


def test_tree_keys_in_generation_config_and_kwargs():
    from transformers import GenerationConfig

    model = hf_model("trained")
    ids = torch.tensor([prompts_for("trained")[0]])
    want = model.generate(ids, max_new_tokens=NEW, do_sample=False)
    gc = GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=257, dsv4_eagle_topk=2, dsv4_num_steps=3,
                          dsv4_num_draft_tokens=6, dsv4_drafter="mtp")
    assert torch.equal(model.generate(ids, generation_config=gc, custom_generate=dt.custom_generate), want)
    chain = model.generate(ids, max_new_tokens=NEW, custom_generate=dt.custom_generate, dsv4_eagle_topk=1,
                           dsv4_num_steps=2, dsv4_drafter="mtp")
    assert torch.equal(chain, want)
    specs = {key[0] for key in model.__dict__["_dsv4_tree_engines"]}
    assert {(s.eagle_topk, s.num_steps, s.num_draft_tokens) for s in specs} >= {(2, 3, 6), (1, 2, 3)}
    with pytest.raises(dt.InputError, match="dsv4_drafter"):
        model.generate(ids, max_new_tokens=2, custom_generate=dt.custom_generate, dsv4_drafter="beam")
    with pytest.raises(dt.ConfigError):
        model.generate(ids, max_new_tokens=2, custom_generate=dt.custom_generate, dsv4_eagle_topk=0)


class AddOne(LogitsProcessor):
    def __call__(self, input_ids, scores):
        return scores + 1


class Never(StoppingCriteria):
    def __call__(self, input_ids, scores, **kw):
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


REFUSED = [
    (dict(num_beams=2), "beam"),
    (dict(do_sample=True, num_beams=2), "beam"),
    (dict(repetition_penalty=1.3), "RepetitionPenalty"),
    (dict(no_repeat_ngram_size=2), "NoRepeatNGram"),
    (dict(bad_words_ids=[[5]]), "NoBadWords"),
    (dict(logits_processor=LogitsProcessorList([AddOne()])), "AddOne"),
    (dict(stopping_criteria=[Never()]), "Never"),
    (dict(max_time=5.0), "MaxTime"),
    (dict(return_dict_in_generate=True, output_scores=True), "output_scores"),
    (dict(return_dict_in_generate=True, output_logits=True), "output_logits"),
    (dict(do_sample=True, typical_p=0.5), "Typical"),
]


@pytest.mark.parametrize("kw,name", REFUSED, ids=[n for _, n in REFUSED])
def test_refused_settings_raise_input_error_naming_them(kw, name):
    model = hf_model("tiny")
    ids = torch.tensor([prompts_for("tiny")[0]])
    with pytest.raises(dt.InputError, match=name):
        model.generate(ids, max_new_tokens=4, custom_generate=dt.custom_generate, **kw)


def test_refused_inputs():
    from transformers import DynamicCache

    model = hf_model("tiny")
    prompts = prompts_for("tiny")
    ids, mask = left_padded(prompts, pad=0)
    right = torch.flip(mask, dims=[1])
    with pytest.raises(dt.InputError, match="left padding"):
        model.generate(ids, attention_mask=right, max_new_tokens=4, custom_generate=dt.custom_generate)
    cache = DynamicCache(config=model.config)
    model(torch.tensor([prompts[0]]), past_key_values=cache)
    with pytest.raises(dt.InputError, match="past_key_values"):
        model.generate(torch.tensor([prompts[0] + [3]]), past_key_values=cache, max_new_tokens=4,
                       custom_generate=dt.custom_generate)
    with pytest.raises(dt.InputError, match="position_ids"):
        model.generate(ids, attention_mask=mask, position_ids=torch.zeros_like(ids), max_new_tokens=4,
                       custom_generate=dt.custom_generate)


def test_num_return_sequences_rows_sampled_independently():
    """transformers expands the rows before calling us; each is its own request."""
    model = hf_model("trained")
    p = heldout_prompt(28, 6)  # an uncertain next byte (test_hf_generate_sampling.py)
    torch.manual_seed(0)
    out = model.generate(torch.tensor([p]), do_sample=True, num_return_sequences=8, max_new_tokens=3,
                         custom_generate=dt.custom_generate)
    assert out.shape == (8, len(p) + 3) and torch.equal(out[:, : len(p)], torch.tensor([p] * 8))
    assert len({tuple(r) for r in out[:, len(p):].tolist()}) > 1, "8 samples of an uncertain byte all equal"


def test_processors_per_node_equal_transformers_per_row():
    """process() gives every node what transformers' LogitsProcessorList gives that node's
    row: the processors we accept, in transformers' order, on nodes of different lengths."""
    from transformers.generation.logits_process import (
        LogitNormalization, MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor, MinPLogitsWarper,
        TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

    from dsv4_tree.hf_generate.target import NodeLengths, process

    eos = torch.tensor([3, 7])
    procs = (MinLengthLogitsProcessor(12, eos), MinNewTokensLengthLogitsProcessor(8, 5, eos),
             TemperatureLogitsWarper(0.7), TopKLogitsWarper(9), TopPLogitsWarper(0.8), MinPLogitsWarper(0.05),
             LogitNormalization())
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([9, 10, 10, 11, 12, 13, 14, 9])  # below, at and past both EOS thresholds
    scores = torch.randn(len(lengths), 32, generator=g) * 3
    scores[:, 3] += 4  # EOS would win where it is not masked
    got = process(procs, scores.clone(), NodeLengths(lengths))
    for row, n in enumerate(lengths.tolist()):
        ids = torch.randint(0, 32, (1, n), generator=g)
        want = LogitsProcessorList(procs)(ids, scores[row : row + 1].clone())
        # the same float32 ops on one row or on a batch of rows: bitwise equal
        assert torch.equal(got[row : row + 1], want), f"{row=} {n=}"
    assert bool(torch.isinf(got[:5, 3]).all()) and not bool(torch.isinf(got[5:7, 3]).any())
