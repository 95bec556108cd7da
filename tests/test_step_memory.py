"""No tensor proportional to rows x context in a long-context verify step with the Triton
backend: the bench_verify Flash-shaped model (SWA, C4 + indexer top-512, C128; bf16, FP8 pools)
runs one verify step (the plan's device table build, then the forward) on the meta device at 1M
context, every aten op's outputs recorded. The tables keep committed entries per request (page
form), never per row.
The Triton backend's indexer and attention kernels run there (the other ops as torch: pooling
and mHC shapes do not depend on the context). An output that grows both with the context (1M vs 512K) and with the rows (N = 8 vs 4 per
request) is rows x context. The torch backend has such tensors (its [B, N x HI, P/4] indexer
scores); the Triton backend's indexer keeps its top-k in registers and its attention reads
C128's committed entries per request, so it has none. On meta the launchers check their inputs
and allocate their outputs without launching (kernels/_meta.py); the kernels allocate nothing."""
import dataclasses
import difflib
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import dsv4_tree as dt
from dsv4_tree import kernels
from dsv4_tree.attention.backend import TORCH_OPS
from dsv4_tree.serving.synth import synthetic_request
from dsv4_tree.tree.simulate import eagle_tree

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_plan import meta_model  # noqa: E402

CONTEXT = 1 << 20


class OutputSizes(TorchDispatchMode):
    """The element count of every device (meta) tensor each aten op returns, in dispatch order
    (the plan's host schedule works on host tensors: not device memory)."""

    def __init__(self):
        super().__init__()
        self.sizes = []  # (op name, numel, shape)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.device.type == "meta":
                self.sizes.append((str(func.overloadpacket), t.numel(), tuple(t.shape)))
        return out


@pytest.fixture(scope="module")
def model():
    return meta_model(3)


def step_sizes(model, backend: str, context: int, nodes: int, batch: int) -> list:
    spec = dt.SpecConfig(eagle_topk=4, num_steps=8, num_draft_tokens=8, prefill_chunk=64, max_requests=batch,
                         max_total_tokens=batch * (CONTEXT + 256), kv_cache_dtype="fp8_e4m3")
    engine = dt.Engine(model, spec)
    if backend == "triton":  # the long-context kernels; the other ops (pooling, mHC) have context-free
        # shapes and no meta path: their torch versions run
        engine.ops = dataclasses.replace(TORCH_OPS, name="triton", indexer_topk=kernels.indexer_topk,
                                         sparse_decode=kernels.sparse_decode)
    reqs = [synthetic_request(engine, context + 13 * b, seed=b) for b in range(batch)]
    trees = [eagle_tree(r.root_token, nodes, topk=4, seed=b, vocab=model.vocab_size) for b, r in enumerate(reqs)]
    with OutputSizes() as rec:  # the device table build and the forward
        engine.run_plan(engine.plan(reqs, trees), reqs)
    return rec.sizes


def rows_by_context(model, backend: str, batch: int) -> list:
    """Outputs that grow with the context and with the rows: [(op, shape at 1M / N 8), ...].
    The op sequence is the same at half the context; at N = 6 the build's host-known branches
    (which blocks close, branch widths) may add or drop a few ops, so the two are aligned by op
    name, and an op of N = 8 with no counterpart at N = 6 counts if it grows with the context."""
    full = step_sizes(model, backend, CONTEXT, 8, batch)
    half_ctx = step_sizes(model, backend, CONTEXT // 2, 8, batch)
    fewer_rows = step_sizes(model, backend, CONTEXT, 6, batch)
    assert [op for op, *_ in full] == [op for op, *_ in half_ctx], "the step's ops depend on the context"
    counterpart = {}
    match = difflib.SequenceMatcher(a=[op for op, *_ in full], b=[op for op, *_ in fewer_rows], autojunk=False)
    for blk in match.get_matching_blocks():
        counterpart.update({blk.a + k: blk.b + k for k in range(blk.size)})
    found = []
    for i, ((op, n, shape), (_, nc, _)) in enumerate(zip(full, half_ctx)):
        j = counterpart.get(i)
        # rows x context: ~2x at twice the context and ~8/6 x at 8/6 the rows (a buffer of
        # context + rows, like the packed step input, grows by a few elements with the rows)
        if n >= 1.5 * nc and (j is None or n >= 1.25 * fewer_rows[j][1]):
            found.append((op, shape))
    return found


@pytest.mark.parametrize("batch", [1, 2])
def test_triton_step_has_no_rows_by_context_tensor(model, batch):
    found = rows_by_context(model, "triton", batch)
    assert not found, f"rows x context tensors in the Triton step at bs {batch}: {found[:5]}"


def test_the_check_finds_the_torch_backends_score_tensor(model):
    found = rows_by_context(model, "torch", 1)
    rows, hi, entries = 8, model.config.index_n_heads, CONTEXT // 4
    assert any(shape == (1, rows * hi, entries) for _, shape in found), found[:5]
