"""The DSpark forward over packed rows (drafters/dspark_rows.py) against the per-request
reference through Hugging Face's own modules (reference/dspark.py).

Bound: relative 1e-4 on logits (design_notes/tolerances.md: the packed path gathers keys per
row and runs each projection as one GEMM over all rows, so it rounds differently from the
dense per-request reference; a visibility bug, one key too many or too few, moves logits by
>1e-2 in these tiny models). Confidences are sigmoids of O(1) logits: 1e-5 absolute."""
from __future__ import annotations

import pytest
import torch

from dsv4_tree.checkpoint.dspark import DSparkSettings
from dsv4_tree.checkpoint.tiny import random_dspark, random_model, tiny_config
from dsv4_tree.drafters.dspark_rows import block_ids, block_index, block_rows, confidences, context_rows, markov_logits
from dsv4_tree.model.adapter import Model
from dsv4_tree.reference import relative_error
from dsv4_tree.reference.dspark import ref_dspark_block, ref_dspark_chain, ref_target_features

CASES = [  # (gamma, markov rank, sliding window, committed lengths of the batch, target layers)
    (5, 8, 8, [3, 20], (1, 2, 3)),
    (3, 4, 16, [1, 16, 17, 40], (0, 2)),
    (7, 32, 8, [9], (3,)),
    (1, 2, 32, [5, 70], (1, 3)),
]


def _model(window: int) -> Model:
    return Model(random_model(tiny_config(sliding_window=window)))


@pytest.mark.parametrize("gamma,rank,window,lengths,layers", CASES)
def test_packed_block_equals_the_reference(gamma, rank, window, lengths, layers):
    model = _model(window)
    v = model.vocab_size
    module = random_dspark(model.config, DSparkSettings(gamma, rank, v - 3, layers))
    g = torch.Generator().manual_seed(sum(lengths) + gamma)
    prompts = [torch.randint(2, v, (p + 1,), generator=g) for p in lengths]
    feats = [ref_target_features(model, x[:-1], layers) for x in prompts]
    los = [max(0, p - window) for p in lengths]
    with torch.no_grad():
        tables = torch.cat([context_rows(model, module, f[lo:], torch.arange(lo, p))
                            for f, lo, p in zip(feats, los, lengths)], 1)
        index = block_index(torch.tensor([p - lo for p, lo in zip(lengths, los)]), gamma)
        anchors = torch.stack([x[-1] for x in prompts])
        blk = block_rows(model, module, block_ids(module, anchors), torch.tensor(lengths), tables, index)
        prev = torch.randint(0, v, (len(lengths), gamma), generator=g)
        logits = markov_logits(module, blk.base, prev)
        conf = confidences(module, blk.hidden, prev)
    for b, (x, f) in enumerate(zip(prompts, feats)):
        base, hidden = ref_dspark_block(model, module, f, int(x[-1]))
        want_logits, want_conf = ref_dspark_chain(module, base, hidden, prev[b])
        case = f"{gamma=} {rank=} {window=} P={lengths[b]} {layers=}"
        assert relative_error(blk.base[b], base) < 1e-4, case
        assert relative_error(blk.hidden[b], hidden) < 1e-4, case
        assert relative_error(logits[b], want_logits) < 1e-4, case
        assert (conf[b] - want_conf).abs().max() < 1e-5, case


def test_block_rows_see_the_whole_block_and_only_the_window():
    """Changing a context row outside the window changes nothing; one inside it, or the anchor
    (row 0, which later rows see: the block is not causal), changes every row."""
    window, gamma, p = 8, 4, 20
    model = _model(window)
    module = random_dspark(model.config, DSparkSettings(gamma, 4, model.vocab_size - 3, (1, 2)))
    g = torch.Generator().manual_seed(3)
    x = torch.randint(2, model.vocab_size, (p + 1,), generator=g)
    f = ref_target_features(model, x[:-1], (1, 2))

    def run(features, anchor):
        return ref_dspark_block(model, module, features, anchor)[0]

    base = run(f, int(x[-1]))
    far = f.clone()
    far[p - window - 1] += 1.0
    assert torch.equal(run(far, int(x[-1])), base)
    near = f.clone()
    near[p - window] += 1.0
    assert (run(near, int(x[-1])) - base).abs().amax(-1).min() > 1e-3
    other = run(f, (int(x[-1]) + 1) % model.vocab_size)
    assert (other[1:] - base[1:]).abs().amax(-1).min() > 1e-3, "later block rows must see the anchor row"


def test_features_are_the_outputs_of_the_target_layers():
    """A target layer's feature is the mean over hc of the streams it outputs: transformers'
    hidden_states[i + 1] (SGLang's DeepSeek-V4 loop and DeepSpec read the same), concatenated in
    ascending layer order; not its input (hidden_states[i]: for layer 0 the embedding). (tests/
    test_dspark_drafter.py checks the engine's captured features against transformers too.)"""
    model = _model(8)
    x = torch.arange(2, 14)
    d = model.config.hidden_size
    got = ref_target_features(model, x, (0, 2))
    with torch.no_grad():
        states = model.hf(input_ids=x.unsqueeze(0), use_cache=False, output_hidden_states=True).hidden_states
    assert got.shape == (12, 2 * d)
    torch.testing.assert_close(got, torch.cat([states[1][0].mean(1), states[3][0].mean(1)], -1), rtol=0, atol=1e-6)
    assert (got[:, :d] - states[0][0].mean(1)).abs().max() > 1e-2  # layer 0's input: the embedding
