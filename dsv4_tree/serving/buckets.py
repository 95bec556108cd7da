"""Static-shape buckets: the shapes one captured plan-build + forward serves.

A bucket fixes the requests B (rounded up to a power of two), the rows T = B * num_draft_tokens,
the nodes per request N = num_draft_tokens, and per ratio the committed-entry width C from the
context bucket (the longest request's pages rounded up to a power of two). Graph memory stays
bounded over a long run: about log2(max batch) x log2(max pages) buckets, not one per context
length. Padding requests have no rows; padding rows belong to no request: they read nothing
(empty index lists), write their K=V / compressor rows to the trash recent slot and their
entries to the trash entry slot, so they never change a real row or reach committed state;
their logits are dropped. Unbucketed steps use the batch's own shapes."""
from __future__ import annotations

from .pools import Layout
from .step import StepShapes


def pow2(n: int, floor: int = 1) -> int:
    """The smallest power of two (at least `floor`) not below n: a bucket's size."""
    p = floor
    while p < n:
        p *= 2
    return p


def step_shapes(sizes, seq_lens, layout: Layout, max_nodes: int | None = None) -> StepShapes:
    """Shapes of a step with trees of `sizes` nodes at committed lengths `seq_lens`; bucketed
    (static) when max_nodes (num_draft_tokens) is given, else exactly the batch's."""
    longest = max(seq_lens)
    if max_nodes is None:
        return StepShapes(len(sizes), sum(sizes), max(sizes),
                          tuple((m, max(1, longest // m)) for m in sorted(layout.ratios)))
    b, ps = pow2(len(sizes)), layout.page_size
    context = pow2(-(-longest // ps)) * ps  # positions of the context bucket
    return StepShapes(b, b * max_nodes, max_nodes, tuple((m, max(1, context // m)) for m in sorted(layout.ratios)))
