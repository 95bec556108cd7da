"""SpecConfig settings act where a user expects them: `accept` picks the acceptance rule of
generate and the CLI, `mask_mode` the layout of the SGLang-compatible tree tensors."""
import json

import pytest
import torch

import dsv4_tree as dt
from cases import prompt, random_tree, small_model
from dsv4_tree.cli import main
from dsv4_tree.tree import TreeMaskMode, build_tree, organize_draft_results, tensors_to_trees, unpack_bits
from dsv4_tree.tree.simulate import simulated_eagle_draft

def engine(accept="greedy", mask_mode="QLEN_ONLY"):
    return dt.Engine(small_model(), dt.SpecConfig(eagle_topk=3, num_steps=4, num_draft_tokens=10, accept=accept,
                                                  mask_mode=mask_mode))


class RandomTrees:
    """A model-free drafter: seeded random trees (cheap; acceptance mechanics only)."""

    def __init__(self, seed):
        self.seed = seed

    def draft(self, engine, requests):
        self.seed += 1
        return [random_tree(r.root_token, 6, 3, 2, self.seed) for r in requests]


def manual_sampling(eng, ids, n, temperature, seed):
    """The rounds generate must run for accept='sampling': accept_sampling with one generator."""
    drafter, gen = RandomTrees(0), torch.Generator().manual_seed(seed)
    req, new = eng.prefill(ids), []
    while len(new) < n:
        tree = drafter.draft(eng, [req])[0]
        out = eng.verify([req], [tree])
        acc = eng.accept_sampling([req], [tree], out, temperature, 1.0, gen)[0]
        emitted = acc.emitted(tree)[: n - len(new)]
        acc = dt.Acceptance(acc.path[: len(emitted)], emitted[-1], acc.request_id, acc.verify_id)
        eng.commit([req], [acc], out)
        new += emitted
    return new


def test_generate_follows_spec_accept():
    ids = prompt(20, 3)
    sampler = engine(accept="sampling")
    for temperature, used in ((None, 1.0), (3.0, 3.0)):  # None: the documented default 1.0
        got = sampler.generate(ids, 8, drafter=RandomTrees(0), temperature=temperature,
                               generator=torch.Generator().manual_seed(7), progress=False)
        assert got.tokens == manual_sampling(sampler, ids, 8, used, 7), f"{temperature=}"
        if temperature == 3.0:
            hot = got.tokens
    greedy = engine().generate(ids, 8, drafter=RandomTrees(0), progress=False)
    assert hot != greedy.tokens  # temperature 3 over 512 tokens: 8 argmaxes in a row would be a bug
    with pytest.raises(dt.InputError, match="accept='sampling': sampling needs temperature > 0"):
        sampler.generate(ids, 4, temperature=0.0, progress=False)
    with pytest.raises(dt.InputError, match="SpecConfig.accept='greedy'"):
        engine().generate(ids, 4, temperature=0.5, progress=False)


def test_cli_generate_follows_accept(capsys, tmp_path):
    args = ["generate", "--max-new-tokens", "10", "--topk", "2", "--num-steps", "3", "--drafter", "ngram"]
    assert main(args + ["--accept", "sampling", "--temperature", "2.0", "--seed", "3"]) == 0
    sampled = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tokens"]
    preset = tmp_path / "sampling.toml"
    preset.write_text('[spec]\naccept = "sampling"\n')
    assert main(args + ["--spec", str(preset), "--temperature", "2.0", "--seed", "3"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tokens"] == sampled
    assert main(args) == 0
    greedy = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tokens"]
    assert sampled != greedy
    assert main(args + ["--temperature", "0.5"]) == 2
    assert "InputError" in capsys.readouterr().err
    assert main(args + ["--accept", "sampling", "--temperature", "0"]) == 2
    assert "temperature > 0" in capsys.readouterr().err


@pytest.mark.parametrize("mode", ["FULL_MASK", "QLEN_ONLY", "QLEN_ONLY_BITPACKING"])
def test_tree_tensors_follow_mask_mode_and_equal_build_tree(mode):
    """Engine.tree_tensors of EAGLE trees equals SGLang's build_tree output in spec.mask_mode."""
    eng = engine(mask_mode=mode)
    reqs = [eng.prefill(prompt(n, 10 + n)) for n in (5, 17)]
    scores, tokens, parents = simulated_eagle_draft(2, 3, 4, seed=4, vocab=500)
    org = organize_draft_results(scores, tokens, parents, 10)
    bonus = torch.tensor([r.root_token for r in reqs])
    seq_lens = torch.tensor([r.seq_len for r in reqs])
    want = build_tree(bonus, org.parent_list, org.top_scores_index, org.draft_tokens, seq_lens, 3, 4, 10,
                      TreeMaskMode[mode])
    trees = tensors_to_trees(want.draft_tokens, want.retrieve_next_token, want.retrieve_next_sibling)
    got = eng.tree_tensors(reqs, trees)
    for name in want._fields:
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and torch.equal(a, b), f"{mode=} {name}"
    if mode == "QLEN_ONLY_BITPACKING":
        assert got.tree_mask.dtype == torch.uint16 and got.tree_mask.shape == (20,)
    with pytest.raises(dt.InputError, match="pending root token"):
        eng.tree_tensors(reqs[:1], trees[1:])


def test_cli_demo_samples_and_saves_tree_tensors_in_mask_mode(capsys, tmp_path):
    path = tmp_path / "tensors.pt"
    assert main(["demo", "--rounds", "2", "--prompt-len", "20", "--spec", "configs/tree_wide.toml",
                 "--num-draft-tokens", "8", "--accept", "sampling", "--temperature", "0.8",
                 "--tensors-out", str(path)]) == 0
    out = capsys.readouterr().out
    assert "accept=sampling temperature=0.8" in out and "PASS" in out
    saved = torch.load(path)
    assert saved["mask_mode"] == "QLEN_ONLY_BITPACKING" and len(saved["rounds"]) == 2
    for rnd in saved["rounds"]:
        mask = rnd["tree_mask"]
        assert mask.dtype == torch.uint8  # <= 8 nodes per row
        tree = dt.DraftTree(rnd["draft_tokens"], rnd["parents"][0])
        assert torch.equal(unpack_bits(mask, tree.num_nodes), tree.ancestors)
