"""The whole verify with attention_backend="triton" (table build, mHC, norms, RoPE, writers,
indexer, attention and commit as kernels) over FP8 pools: trees and chains at contexts whose
draft rows close C4 and C128-style (here C16) blocks, across page boundaries, against the torch
backend over the same pools: logits and stored bytes. The torch backend over FP8 pools is held to fp32
Hugging Face in test_kv_dtypes.py, the Triton backend over fp32 pools to per-path Hugging Face
runs in test_kernels.py, and the Triton commit moves the torch commit's bytes bitwise in
test_commit_kernel.py."""
import pytest
import torch

import dsv4_tree as dt
from cases import deep_chain_tree, prompt, random_tree, small_model
from dsv4_tree.reference import relative_error
from test_kv_dtypes import CHAIN_TOL


def verified(backend: str, length: int, tree_of, page_size: int = 16):
    spec = dt.SpecConfig(eagle_topk=4, num_steps=8, num_draft_tokens=24, kv_cache_dtype="fp8_e4m3",
                         page_size=page_size, attention_backend=backend)
    eng = dt.Engine(small_model(), spec)
    p = prompt(length, 11)
    req = eng.prefill(p)
    tree = tree_of(req.root_token)
    return eng, p, req, tree, eng.verify([req], [tree])


def record_bytes(eng, slots) -> list:
    out = []
    for lp in eng.runtime.pools:
        out.append(lp.swa.record_bytes(slots))
    return out


# small_model: C4 and C16 layers, window 8, index top-3. P = 14: the draft rows sit at positions
# 14..22; the row at depth 1 closes C4 block 12..15 and the first C16 block (0..15: a branch
# entry), depth 5 closes C4 block 16..19. P = 18: one committed C16 entry that every row reads,
# four committed C4 entries the indexer chooses 3 of, C4 closes at 19 and 23. Page size 16:
# every tree crosses a page.
CASES = [(14, "tree"), (18, "chain")]


@pytest.mark.parametrize("length,kind", CASES)
def test_triton_verify_over_fp8_pools_matches_the_torch_backend(length, kind):
    def tree_of(root):
        return deep_chain_tree(root, 8, 3) if kind == "chain" else random_tree(root, 24, 8, 3, 5)

    t_eng, p, t_req, tree, t_out = verified("triton", length + 1, tree_of)
    r_eng, _, r_req, _, r_out = verified("torch", length + 1, tree_of)
    assert t_req.seq_len == length and tree.max_depth >= 6
    assert t_out.topk_ties == 0 and r_out.topk_ties == 0, "an indexer boundary tie: choose another seed"
    # Both backends store the same values up to last-bit differences of fp32 sums taken in another
    # order; one that lands on an FP8 rounding boundary moves logits by ~1e-3, a wrong row or
    # entry by >= 0.5 (test_kv_dtypes.py: CHAIN_TOL).
    err = relative_error(t_out.logits[0], r_out.logits[0])
    assert err <= CHAIN_TOL, f"P={length} {kind}: triton vs torch backend {err:.2e} > {CHAIN_TOL:.0e}"
    rows = torch.arange(tree.num_nodes)
    flips = total = 0
    for tb, rb in zip(record_bytes(t_eng, t_out.plan.out_loc[rows]), record_bytes(r_eng, r_out.plan.out_loc[rows])):
        flips += int((tb != rb).sum())
        total += rb.numel()
    # last-bit differences may flip a few stored codes; a structural bug changes most bytes
    assert flips <= 0.01 * total, f"{flips} of {total} stored bytes differ between the backends"

