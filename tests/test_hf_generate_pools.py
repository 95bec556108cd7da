"""custom_generate's pools hold every row of the call: a kept engine too small for a request is
replaced, rows past the default pool size (2**18 tokens, about a quarter of V4-Flash's
1,048,576 positions) get pools for them, and a row cut short for want of pages raises instead
of coming back shorter than transformers' row."""
import pytest
import torch
from transformers import DeepseekV4ForCausalLM

import dsv4_tree as dt
from dsv4_tree.hf_generate import run
from dsv4_tree.hf_generate.engines import ENGINES_ATTR, engine_for, holds
from dsv4_tree.hooks import validate_spec
from dsv4_tree.model.adapter import Model
from dsv4_tree.serving.runtime import DEFAULT_TOKEN_CAP, make_layout
from test_hf_generate import hf_model, left_padded, prompts_for

NEW = 12
# page 16, one row, 16 tokens: a token pool of 1 + 1 pages (32 slots) for a row that needs
# 27 prompt + 12 new + 8 draft slots
SMALL = dict(page_size=16, max_requests=1, max_total_tokens=16)


def tree_spec(model):
    return run.choose_tree(model, model.generation_config, {"dsv4_drafter": "ngram"})[1]


def small_engine(model) -> dt.Engine:
    return dt.Engine(model, tree_spec(model).replace(**SMALL))


def test_a_kept_engine_too_small_for_the_request_is_replaced():
    """The kept engine's pools are smaller than prompt + max_new_tokens + one tree (as the
    default 2**18-token pools are for a V4-Flash row past 262K tokens): custom_generate runs on
    pools that hold the row and returns transformers' whole row."""
    model = hf_model("tiny")
    p = prompts_for("tiny")[0]
    ids = torch.tensor([p])
    want = model.generate(ids, max_new_tokens=NEW, do_sample=False)
    spec = tree_spec(model)
    key = (spec, model.lm_head.weight.device, model.lm_head.weight.dtype)
    engines = model.__dict__.setdefault(ENGINES_ATTR, {})
    kept = engines.get(key)
    engines[key] = small_engine(model)
    try:
        got = model.generate(ids, max_new_tokens=NEW, do_sample=False, custom_generate=dt.custom_generate,
                             dsv4_drafter="ngram")
        assert got.shape == want.shape and torch.equal(got, want), f"{got.shape=} {want.shape=} {SMALL=}"
        layout = engines[key].runtime.layout
        assert holds(layout, [len(p) + NEW + spec.num_draft_tokens]), f"{layout=}"
    finally:
        if kept is not None:
            engines[key] = kept


def test_pools_for_a_row_past_the_default_size():
    """max_position_embeddings 1,048,576 (V4-Flash's): one row of 300,000 + 8 positions does not
    fit the default pools (min(16 x 1,048,576, 2**18) tokens) and gets pools that hold it; a
    short row keeps the default size."""
    hf = DeepseekV4ForCausalLM(dt.tiny_config(max_position_embeddings=1 << 20)).eval()
    spec = tree_spec(hf)
    engine = engine_for(hf, spec, [torch.arange(8)], 300_000)
    row = 8 + 300_000 + spec.num_draft_tokens
    assert engine.spec.max_total_tokens == 1 << 19 and holds(engine.runtime.layout, [row]), f"{engine.spec=}"
    default = spec.replace(max_total_tokens=DEFAULT_TOKEN_CAP)
    assert not holds(make_layout(Model(hf), default, validate_spec(hf.config, default)), [row])
    assert engine_for(hf, spec, [torch.arange(8)], 300_000) is engine, "the kept engine serves the next call"
    del hf.__dict__[ENGINES_ATTR]
    assert engine_for(hf, spec, [torch.arange(8)], 100).spec.max_total_tokens is None


def test_a_row_cut_short_raises_naming_the_pool(monkeypatch):
    """Pools too small for the rows (here: engine_for's sizing bypassed) end them out_of_pages in
    generate_batch; custom_generate raises StateError naming the pool and the setting instead
    of returning rows shorter than transformers' (or, for a batch with neither pad_token_id nor
    EOS, an error about padding)."""
    model = hf_model("tiny")
    small = small_engine(model)
    monkeypatch.setattr(run, "engine_for", lambda *args: small)
    prompts = prompts_for("tiny")[:2]
    ids, mask = left_padded(prompts, pad=0)
    for args, kw in (((ids,), dict(attention_mask=mask)), ((ids[1:],), dict(pad_token_id=0, eos_token_id=1))):
        with pytest.raises(dt.StateError, match=r"row 0 ran out of pool pages after \d+ of max_new_tokens=12.*"
                                                r"max_total_tokens=16"):
            model.generate(*args, max_new_tokens=NEW, do_sample=False, custom_generate=dt.custom_generate,
                           dsv4_drafter="ngram", **kw)
        assert small.runtime.live_slots() == {"token": 0, "recent": 0}, f"the cut rows were released {kw=}"
