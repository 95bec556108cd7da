"""The DSpark forward over packed rows (drafters/dspark_rows.py) against the per-request
reference through Hugging Face's own modules (reference/dspark.py).

Bound: relative 1e-4 on logits (design_notes/tolerances.md: the packed path gathers keys per
row and runs each projection as one GEMM over all rows, so it rounds differently from the
dense per-request reference; a visibility bug, one key too many or too few, moves logits by
>1e-2 in these tiny models). Confidences are sigmoids of O(1) logits: 1e-5 absolute."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from dsv4_tree.checkpoint.dspark import DSparkSettings
from dsv4_tree.checkpoint.tiny import random_dspark, random_model, tiny_config
from dsv4_tree.drafters.dspark_graphs import padded_block
from dsv4_tree.drafters.dspark_rows import confidences, context_rows, markov_logits
from dsv4_tree.executor.graphs import pack_windows
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


def _packed_and_reference(model, module, lengths, temperatures=None, seed=0):
    """The packed path and the reference for one batch: [(packed base, hidden, logits, confidence),
    (reference ...)] per request."""
    v, window, gamma = model.vocab_size, model.window, module.block_size
    layers = module.settings.target_layer_ids
    g = torch.Generator().manual_seed(sum(lengths) + gamma + seed)
    prompts = [torch.randint(2, v, (p + 1,), generator=g) for p in lengths]
    feats = [ref_target_features(model, x[:-1], layers) for x in prompts]
    los = [max(0, p - window) for p in lengths]
    with torch.no_grad():
        tables, kept = pack_windows([context_rows(model, module, f[lo:], torch.arange(lo, p))
                                     for f, lo, p in zip(feats, los, lengths)], window, dim=1)
        anchors = torch.stack([x[-1] for x in prompts])
        blk = padded_block(model, module, anchors, torch.tensor(lengths), tables, torch.tensor(kept), window)
        prev = torch.randint(0, v, (len(lengths), gamma), generator=g)
        logits = markov_logits(module, blk.base, prev)
        conf = confidences(module, blk.hidden, prev, temperatures)
    out = []
    for b, (x, f) in enumerate(zip(prompts, feats)):
        base, hidden = ref_dspark_block(model, module, f, int(x[-1]))
        want_logits, want_conf = ref_dspark_chain(module, base, hidden, prev[b], temperatures)
        out.append(((blk.base[b], blk.hidden[b], logits[b], conf[b]), (base, hidden, want_logits, want_conf)))
    return out


def _check(pairs, case):
    for b, (got, want) in enumerate(pairs):
        for name, x, y in zip(("base", "hidden", "logits"), got[:3], want[:3]):
            assert relative_error(x, y) < 1e-4, f"{case} request {b} {name}"
        assert (got[3] - want[3]).abs().max() < 1e-5, f"{case} request {b} confidence"


@pytest.mark.parametrize("gamma,rank,window,lengths,layers", CASES)
def test_packed_block_equals_the_reference(gamma, rank, window, lengths, layers):
    model = _model(window)
    module = random_dspark(model.config, DSparkSettings(gamma, rank, model.vocab_size - 3, layers))
    _check(_packed_and_reference(model, module, lengths), f"{gamma=} {rank=} {window=} {lengths=} {layers=}")


def test_sample_from_anchor_false_confidence_without_markov_and_sts_temperatures():
    """SGLang's other settings: without sample_from_anchor the block is gamma + 1 rows and row k
    gives U_k (the anchor row only feeds the others); confidence_head_with_markov false reads h_k
    alone; STS temperatures divide each depth's raw confidence. Packed path = reference for each,
    and each changes what is drafted (against the defaults)."""
    model = _model(16)
    base = DSparkSettings(4, 8, model.vocab_size - 3, (0, 2))
    default = _packed_and_reference(model, random_dspark(model.config, base, seed=3), [7, 30])
    temps = torch.tensor([0.5, 1.0, 2.0, 4.0])
    for settings, t in ((dataclasses.replace(base, sample_from_anchor=False), None),
                        (dataclasses.replace(base, confidence_with_markov=False), None),
                        (base, temps)):
        module = random_dspark(model.config, settings, seed=3)
        assert module.settings.block_rows == (5 if not settings.sample_from_anchor else 4)
        pairs = _packed_and_reference(model, module, [7, 30], t)
        _check(pairs, f"{settings} {t=}")
        which = 0 if not settings.sample_from_anchor else 3  # U_k, or the confidences
        assert (pairs[0][1][which] - default[0][1][which]).abs().max() > 1e-3, f"{settings} {t=} changes nothing"


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


def test_sts_files_are_read_or_refused_by_name(tmp_path):
    from dsv4_tree.checkpoint.dspark_sts import read_sts
    from dsv4_tree.errors import CheckpointError, InputError

    path = tmp_path / "sts.json"
    path.write_text('{"temperatures": [0.5, 2], "dataset": "x", "num_samples": 3, "ece_before": [], "ece_after": []}')
    assert read_sts(path, 2) == (0.5, 2.0) and read_sts([1, 3.5], 2) == (1.0, 3.5)
    for text, match in (('{"temperatures": [1, 2], "bins": 4}', "unknown STS key bins"),
                        ('{"dataset": "x"}', "has no temperatures"), ("[1, 2]", "holds a JSON object, got list"),
                        ('{"temperatures": [1, 0]}', "finite number > 0, got 0"),
                        ('{"temperatures": [1, 2, 3]}', "3 temperatures, the module drafts dspark_block_size=2")):
        path.write_text(text)
        with pytest.raises(CheckpointError, match=match):
            read_sts(path, 2)
    with pytest.raises(InputError, match="confidence_sts: every temperature must be a finite number > 0, got nan"):
        read_sts([1.0, float("nan")], 2)
