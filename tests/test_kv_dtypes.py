"""Tree verify over bf16 and FP8 pools (fp32 weights): trees equal chains of their paths over
the same pools, speculation changes no greedy token, and the error against fp32 Hugging Face
is measured per storage dtype."""
import functools

import pytest
import torch

import dsv4_tree as dt
from cases import prompt, random_tree
from dsv4_tree.reference import per_path_logits, relative_error
from dsv4_tree.train.corpus import heldout_prompt

# A draft row computed inside a 24-row tree and inside a short chain can differ in its last
# fp32 bits (other GEMM shapes); a value on an FP8 / bf16 rounding boundary then lands on the
# neighbouring code and moves logits by ~1e-3. Structural bugs (a sibling's row or entry
# leaking in) move them by >= 0.5, so 5e-3 still separates rounding from bugs.
CHAIN_TOL = 5e-3
# Worst relative logit error against fp32 Hugging Face per-path runs, measured on this test's
# case (tiny random checkpoint, P = 299, 24-node tree): auto 7.6e-7, bfloat16 1.4e-2,
# fp8_e4m3 7.6e-2. Ceilings at ~3x the measurement: storage rounding (bf16: 2^-9 relative per
# value; e4m3: 2^-4 per value, power-of-two tile scales) compounds through 4 layers.
HF_BOUND = {"auto": 1e-4, "bfloat16": 5e-2, "fp8_e4m3": 2.5e-1}


@functools.lru_cache(maxsize=None)
def tiny():
    return dt.load_model(dt.tiny_checkpoint())


def verified_case(kv, length, seed, page_size=16):
    """(engine, prompt, request, tree, verify output): a 24-node tree verified over kv pools."""
    eng = dt.Engine(tiny(), dt.SpecConfig(eagle_topk=4, num_steps=8, num_draft_tokens=24, kv_cache_dtype=kv,
                                          page_size=page_size))
    p = prompt(length, seed)
    req = eng.prefill(p)
    tree = random_tree(req.root_token, 24, 8, 3, seed + 2)
    return eng, p, req, tree, eng.verify([req], [tree])


def stored(eng, out, rows):
    return [lp.swa.record_bytes(out.plan.out_loc[rows]) for lp in eng.runtime.pools]


@pytest.mark.parametrize("kv", ["bfloat16", "fp8_e4m3"])
def test_tree_nodes_equal_chain_verify_of_their_path(kv):
    eng, _, req, tree, out = verified_case(kv, 300, 3)
    assert out.topk_ties == 0
    tree_bytes = stored(eng, out, torch.arange(tree.num_nodes))
    flips = total = 0
    for leaf in tree.leaves.tolist():
        path = tree.path[leaf][tree.path[leaf] >= 0]
        chain = eng.verify([req], [dt.DraftTree.chain(tree.tokens[path])])
        err = relative_error(out.logits[0][path], chain.logits[0])
        assert err <= CHAIN_TOL, f"{kv=} leaf {leaf}: tree rows differ from the chain of their path by {err:.2e}"
        for tb, cb in zip(tree_bytes, stored(eng, chain, torch.arange(path.numel()))):
            flips += int((tb[path] != cb).sum())
            total += cb.numel()
    # last-bit differences may flip a few stored codes; a structural bug would change most bytes
    assert flips <= 0.01 * total, f"{kv=}: {flips} of {total} stored bytes differ between tree and chain rows"


@pytest.mark.parametrize("kv", ["auto", "bfloat16", "fp8_e4m3"])
def test_error_against_fp32_hugging_face_per_dtype(kv):
    _, p, _, tree, out = verified_case(kv, 300, 3, page_size=256)
    err = relative_error(out.logits[0], per_path_logits(tiny(), p[:-1], tree))
    print(f"kv_cache_dtype={kv}: worst relative error vs fp32 HF per-path = {err:.2e}")
    assert err <= HF_BOUND[kv], f"{kv=}: {err:.2e} > {HF_BOUND[kv]:.0e}"
    if kv != "auto":
        assert err > 1e-5, f"{kv=}: error {err:.2e} is too small for rounded storage; is the pool really {kv}?"


class NoDraft:
    """Plain decoding: a one-node tree (the pending root) per round."""

    def draft(self, engine, requests):
        return [dt.DraftTree.chain([r.root_token]) for r in requests]


@pytest.mark.parametrize("kv", ["bfloat16", "fp8_e4m3"])
def test_greedy_speculation_equals_plain_greedy(kv):
    model = dt.load_model(dt.trained_checkpoint())
    eng = dt.Engine(model, dt.SpecConfig(eagle_topk=4, num_steps=4, num_draft_tokens=8, kv_cache_dtype=kv))
    text = heldout_prompt(120, 7)
    spec = eng.generate(text, 64, drafter="mtp")
    plain = eng.generate(text, 64, drafter=NoDraft())
    assert spec.tokens == plain.tokens, f"{kv=}"
    assert spec.stats.mean_tokens_per_verify > 1.2, f"{kv=}: drafts were hardly accepted"


@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
def test_commit_equals_serial_decode_in_stored_bytes(kv):
    """Pools after a tree commit hold the records serial decoding of the accepted tokens
    stores: identical bytes, except stored codes flipped by last-bit differences of rows
    computed in GEMMs of other shapes (counted; each at most one quantum of its value)."""
    model = tiny()
    eng, p, req, tree, out = verified_case(kv, 140, 10)
    node = int(tree.depth.argmax())
    path = tree.path[node][tree.path[node] >= 0]
    eng.commit([req], [dt.Acceptance(tuple(path.tolist()), 9, req.request_id, out.verify_id)], out)
    serial = eng.prefill(torch.cat([p, tree.tokens[path[1:]], torch.tensor([9])]))
    assert serial.seq_len == req.seq_len and torch.equal(serial.tokens, req.tokens)
    rt = eng.runtime
    flips = total = 0
    pos = torch.arange(req.seq_len - min(req.seq_len, model.window), req.seq_len)
    for li, lp in enumerate(rt.pools):
        pools = [(lp.swa, lambda r: rt.pages.recent_slots(rt.pages.token_slots(torch.full_like(pos, r), pos)))]
        for comp in lp.compressors:
            k = torch.arange(req.seq_len // comp.ratio)
            pools.append((comp.entries, lambda r, k=k, m=comp.ratio: rt.layout.entry_slot(
                m, rt.pages.token_slots(torch.full_like(k, r), k * m))))
        for pool, slots in pools:
            a, b = pool.record_bytes(slots(req.row)), pool.record_bytes(slots(serial.row))
            flips += int((a != b).sum())
            total += a.numel()
            va, vb = pool.read(slots(req.row)).float(), pool.read(slots(serial.row)).float()
            # one e4m3 quantum is at most 1/8 of the value's magnitude (3 mantissa bits); fp32 rows
            # of O(1) values differ in their last bits (the committed-state bound, 1e-5 absolute)
            step, floor = (0.125, 1e-6) if kv == "fp8_e4m3" else (1e-5, 1e-5)
            bound = step * torch.maximum(va.abs(), vb.abs()) + floor
            worst = float(((va - vb).abs() - bound).max()) if va.numel() else 0.0
            assert worst <= 0, f"{kv=} layer {li}: a stored value moved {worst:.2e} past a quantum (max {float((va - vb).abs().max()):.2e})"
    print(f"{kv=}: {flips} of {total} stored bytes differ between commit and serial decode")
    if kv == "fp8_e4m3":  # fp32 ("auto") rows differ in last bits almost everywhere; codes rarely flip
        assert flips <= 0.02 * total, f"{kv=}: {flips} of {total} stored bytes differ"
