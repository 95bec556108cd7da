"""The sm_90a gate covers what the library launches (design_notes/aot-gate.md, "Coverage").

A real run of each public path at V4-Flash dims, as a GPU user's defaults launch it (SpecConfig's
"auto" pools, and FP8; verify bucketed as on CUDA, where cuda_graph_max_bs None pads every batch
of at most max_requests requests to its bucket: here forced on the CPU with cuda_graph_max_bs),
is recorded with the numeric kernels skipped (dsv4_tree/aot/record.py): prefill_batch (a
256-row chunk and its tail), tree verify and chain verify at several batch sizes, the greedy
accept and commit, and the SGLang plug-in's compressor on SGLang's fp32 kv_score rows. Every
specialisation it launches must be in the gate's set, the scenarios derived from the launch rules
(dsv4_tree/aot/launch_rules.py). Recording is fast (record.py: numeric kernels and dense
products skipped, the torch table build) over a model with zero weights. Every push: the sample,
a chain of 4 alone and a tree of 8 in a batch of 3 (padded to 4), "auto" pools, against the rules'
sample (`flash-sample`, the same N and batch sizes at every context class; ~10 s), and the
planted fault. Nightly: the wide run, N 1 to 64 at 1, 2, 5, 9 and 16 requests in both pools
against the full derived set, which the slow gate compiles (~2 min). The public runs' contexts
(4301 + 7 i) are not the rules' (4200 + offsets): the rules must reach every class on their own."""
from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("DSV4_TREE_GPU") == "1", reason="records under the interpreter")


def _public_run(model, pools: str, pairs, context: int = 4200) -> None:
    """The public API as a user calls it: prefill, then per (N, batch size) a tree (or, at N 4,
    a chain: SGLang's default MTP chain) verified, accepted and committed."""
    import dsv4_tree as dt
    from dsv4_tree.serving.synth import synthetic_request
    from dsv4_tree.tree.simulate import eagle_tree

    for i_pair, (n, b) in enumerate(pairs):
        spec = dt.SpecConfig(eagle_topk=1 if n == 4 else 4, num_steps=max(2, n - 1 if n == 4 else n), num_draft_tokens=n,
                             kv_cache_dtype=pools, attention_backend="triton", max_total_tokens=1 << 17,
                             cuda_graph_max_bs=16)  # the CUDA default (max_requests), forced on the CPU
        eng = dt.Engine(model, spec)
        if i_pair == 0:  # prefill: one prompt, and two at once (generate_batch's path)
            g = torch.Generator().manual_seed(0)
            eng.release(eng.prefill(torch.randint(2, 1000, (260,), generator=g).tolist()))
            for r in eng.prefill_batch([torch.randint(2, 1000, (259,), generator=g).tolist() for _ in range(2)]):
                eng.release(r)
        reqs = [synthetic_request(eng, context + 7 * i, seed=i) for i in range(b)]
        trees = [dt.DraftTree.chain([5] + [7] * (n - 1)) if n == 4 else eagle_tree(5, n, seed=i) for i in range(b)]
        out = eng.verify(reqs, trees)
        eng.commit(reqs, eng.accept_greedy(reqs, trees, out), out)
        for r in reqs:
            eng.release(r)


def _plugin_compressor() -> None:
    """sglang_plugin/compressor.py's pooling as it runs inside SGLang (fp32 kv_score rows, a bf16
    model's norm weight), the call the gate's `extra` scenario makes."""
    from dsv4_tree.aot.scenarios import plugin_pool_entries

    plugin_pool_entries("cpu", weight_dtypes=(torch.bfloat16,))


def _recorded(fn) -> dict:
    from dsv4_tree.aot.record import LaunchRecorder

    with LaunchRecorder(where="public") as rec:
        fn()
    return {k: r.spec for k, r in rec.seen.items()}


def _missing(launched: dict, gate: dict) -> list:
    return sorted(f"{s.name} {s.short()}" for k, s in launched.items() if k not in gate)


@pytest.fixture(scope="module")
def flash_model():
    from dsv4_tree.aot.scenarios import model_for

    return model_for("flash", weights="zeros")


def test_every_spec_a_public_run_launches_is_in_the_gates_set(flash_model):
    from dsv4_tree.aot.scenarios import record

    gate = {s.key(): s for s, _ in record(("flash-sample", "extra"))}
    launched = _recorded(lambda: _public_run(flash_model, "auto", ((4, 1), (8, 3)), context=4301))
    launched.update(_recorded(_plugin_compressor))
    assert len(launched) >= 40, "the public paths launch every kernel of the verify step"
    assert _missing(launched, gate) == [], "\n".join(_missing(launched, gate))


def test_the_gates_old_hand_picked_set_missed_launches(flash_model):
    """The planted fault: the hand-picked scenarios the gate had (FP8 pools, unbucketed, bs <= 2)
    miss specialisations a default run launches; the check above must see that."""
    from dsv4_tree.aot.scenarios import record

    old = {s.key(): s for s, _ in record(("flash-verify", "flash-more"))}
    launched = _recorded(lambda: _public_run(flash_model, "auto", ((8, 3),)))
    assert _missing(launched, old), "an auto-pool, bucketed run at bs 3 launched nothing the old set lacked"


@pytest.mark.slow  # ~2 min on the 2-core machine
def test_every_spec_of_the_wider_public_run_is_in_the_full_derived_set(flash_model):
    from dsv4_tree.aot.scenarios import record

    gate = {s.key(): s for s, _ in record(("flash-rules", "extra"))}  # compiled by test_aot_gate's rules test
    launched = {}
    pairs = tuple((n, b) for n in (1, 2, 4, 8, 16, 64) for b in (1, 2, 5, 9, 16))
    for pools in ("auto", "fp8_e4m3"):
        launched.update(_recorded(lambda: _public_run(flash_model, pools, pairs, context=4301)))
    launched.update(_recorded(_plugin_compressor))
    assert _missing(launched, gate) == [], "\n".join(_missing(launched, gate))
