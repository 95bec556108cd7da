"""CUDA-graph capture and replay of the verify forward, one graph per static-shape bucket.

The plan's tensors are copied into the bucket's static buffers, the captured forward is
replayed, and its outputs are cloned out. Everything the forward writes (pools) is addressed
through those buffers, so a replay with a new plan writes exactly where an eager run would."""
from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass

import torch

from ..serving.step import StepShapes
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
        elif is_dataclass(a):
            _copy_into(a, b)


@dataclass
class _Captured:
    graph: "torch.cuda.CUDAGraph"
    plan: VerifyPlan  # static buffers the graph reads
    out: RowsRun  # static outputs the graph writes


class GraphCache:
    def __init__(self, model, pools, ops):
        self.model, self.pools, self.ops = model, pools, ops
        self.graphs: dict = {}

    @torch.inference_mode()  # as run_rows: the static buffers may be inference tensors
    def run(self, plan: VerifyPlan, bucket: StepShapes) -> RowsRun:
        """plan: padded to `bucket`, on the model's (CUDA) device."""
        cap = self.graphs.get(bucket)
        if cap is None:
            cap = self.graphs[bucket] = self._capture(plan)
        else:
            _copy_into(cap.plan, plan)
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
