"""Soak: 2,000 greedy tokens on the trained checkpoint with a tree MTP drafter equal Hugging
Face's own cached greedy decoding token for token. About a minute on 2 idle CPU cores (HF's
cached greedy ~26 s, ours ~27 s), so it runs by default; marked `slow` for `-m "not slow"`."""
import copy
import time

import pytest
import torch

import dsv4_tree as dt
from dsv4_tree.drafters import MtpDrafter, TreeShape
from dsv4_tree.train.corpus import heldout_prompt

NEW = 2000


@pytest.mark.slow
def test_soak_tree_mtp_greedy_equals_hf_cached_greedy():
    model = dt.load_model(dt.trained_checkpoint())
    ids = torch.tensor(heldout_prompt(200, 11))
    config = copy.deepcopy(model.hf.generation_config)
    config.eos_token_id = None  # run the full budget; our generate has no EOS either
    config.do_sample, config.max_new_tokens, config.use_cache = False, NEW, True
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.hf.generate(ids.unsqueeze(0), generation_config=config)
    want = out[0, ids.numel():].tolist()
    t_hf = time.perf_counter() - t0
    assert len(want) == NEW
    shape = TreeShape(4, 4, 8)
    eng = dt.Engine(model, dt.SpecConfig(eagle_topk=shape.topk, num_steps=shape.num_steps,
                                         num_draft_tokens=shape.num_draft_tokens))
    t0 = time.perf_counter()
    res = eng.generate(ids, NEW, drafter=MtpDrafter(model, shape), progress=False)
    t_ours = time.perf_counter() - t0
    first = next((i for i, (a, b) in enumerate(zip(res.tokens, want)) if a != b), None)
    assert res.tokens == want, f"first difference at token {first} of {NEW}"
    assert res.stats.mean_tokens_per_verify > 1.5, res.stats.histogram
    print(f"soak: {NEW} tokens, HF cached greedy {t_hf:.1f}s, tree MTP speculative {t_ours:.1f}s "
          f"({res.stats.rounds} verifies, {res.stats.mean_tokens_per_verify:.2f} tokens/verify)")
