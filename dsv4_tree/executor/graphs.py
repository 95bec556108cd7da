"""CUDA-graph capture and replay of the verify forward, one graph per static-shape bucket.

The plan's tensors are copied into the bucket's static buffers, the captured forward is
replayed, and its outputs are cloned out. Everything the forward writes (pools) is addressed
through those buffers, so a replay with a new plan writes exactly where an eager run would."""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ..serving.buckets import Bucket
from ..serving.tables import VerifyPlan
from .forward import RowsRun, run_rows


def _copy_into(static, new) -> None:
    for f in fields(static):
        a, b = getattr(static, f.name), getattr(new, f.name)
        if isinstance(a, torch.Tensor):
            a.copy_(b, non_blocking=True)
        elif isinstance(a, dict):
            for k in a:
                _copy_into(a[k], b[k])


@dataclass
class _Captured:
    graph: "torch.cuda.CUDAGraph"
    plan: VerifyPlan  # static buffers the graph reads
    out: RowsRun  # static outputs the graph writes


MAX_GRAPHS = 16  # captured graphs kept at once (least recently used dropped first)


class GraphCache:
    """Captured graphs by bucket. Buckets grow with the context (entry-table widths are powers
    of two), so over a long run the count is bounded: at most MAX_GRAPHS graphs and their memory
    are held, the least recently replayed one released first."""

    def __init__(self, model, pools, ops, max_graphs: int = MAX_GRAPHS):
        self.model, self.pools, self.ops = model, pools, ops
        self.graphs: dict = {}  # bucket -> _Captured, least recently used first
        self.max_graphs = max_graphs

    @torch.inference_mode()  # as run_rows: the static buffers may be inference tensors
    def run(self, plan: VerifyPlan, bucket: Bucket) -> RowsRun:
        """plan: padded to `bucket`, on the model's (CUDA) device."""
        cap = self.graphs.pop(bucket, None)
        if cap is None:
            while len(self.graphs) >= self.max_graphs:
                self.graphs.pop(next(iter(self.graphs)))  # its graph and buffers go with it
            cap = self._capture(plan)
        else:
            _copy_into(cap.plan, plan)
        self.graphs[bucket] = cap  # most recently used last
        cap.graph.replay()
        o = cap.out
        return RowsRun(o.logits.clone(), o.topk_ties.clone(), o.hidden.clone())

    def _capture(self, plan: VerifyPlan) -> _Captured:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up (allocator, lazy inits); writes what verify writes
            run_rows(self.model, plan, self.pools, self.ops)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run_rows(self.model, plan, self.pools, self.ops)
        return _Captured(graph, plan, out)
