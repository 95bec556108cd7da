"""CUDA-graph capture and replay of a whole verify step's device half: the table build
(serving/step.py build_from) and the forward, one graph per static-shape bucket.

A step's device inputs (its staged int32 buffer) are copied into the bucket's static input
buffer, the captured build + forward is replayed, and its outputs are cloned out. Everything
the graph writes (pools) is addressed through tables it builds from those inputs and from the
device page tables (updated in place before the replay), so a replay writes exactly where an
eager run would. The number of graphs is bounded by the buckets: powers of two in requests and
in context pages (serving/buckets.py), not one per context length."""
from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass
from typing import Callable

import torch

from ..errors import StateError
from ..serving.step import StepShapes, build_from
from ..serving.tables import VerifyPlan
from .forward import RowsRun, run_rows


def copy_into(static, new) -> None:
    """Copy every tensor of `new` into the same place of `static` (nested dicts, tuples, dataclasses)."""
    if isinstance(static, torch.Tensor):
        static.copy_(new, non_blocking=True)
    elif isinstance(static, dict):
        for k in static:
            copy_into(static[k], new[k])
    elif isinstance(static, (tuple, list)):
        for a, b in zip(static, new):
            copy_into(a, b)
    elif is_dataclass(static) and not isinstance(static, type):
        for f in fields(static):
            copy_into(getattr(static, f.name), getattr(new, f.name))


def cuda_capture(fn: Callable):
    """Warm up fn on a side stream (allocator, lazy inits), capture it; -> (replay, static outputs)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph.replay, out


def eager_capture(fn: Callable):
    """The same contract without CUDA (tests on any device): replay reruns fn and copies its
    results into the outputs of the first run, as a graph replay refills its static outputs."""
    out = fn()
    return (lambda: copy_into(out, fn())), out


@dataclass
class _Captured:
    replay: Callable
    inputs: torch.Tensor  # [3B + 2T] static input buffer the graph reads
    tables: dict  # static tables (VerifyPlan tensor fields) the graph writes
    out: RowsRun  # static outputs the graph writes


MAX_GRAPHS = 16  # captured graphs kept at once (least recently used dropped first)


class GraphCache:
    """Captured steps by bucket (batch, N, context in pages, all rounded to powers of two). Over
    a long run at most max_graphs graphs and their memory are held: the least recently
    replayed one is released first."""

    def __init__(self, model, runtime, ops, capture: Callable = cuda_capture, max_graphs: int = MAX_GRAPHS,
                 feature_layers: tuple = ()):
        self.model, self.runtime, self.ops, self.capture = model, runtime, ops, capture
        self.feature_layers = tuple(feature_layers)  # run_rows' RowsRun.features layers
        self.graphs: dict = {}  # shapes -> _Captured, least recently used first
        self.max_graphs = max_graphs

    @torch.inference_mode()  # as run_rows: the static buffers may be inference tensors
    def run(self, staged: torch.Tensor, shapes: StepShapes) -> tuple:
        """staged: a graphed plan's device inputs. -> (RowsRun (cloned), the static tables: valid
        until this bucket's next replay)."""
        cap = self.graphs.pop(shapes, None)
        if cap is None:  # capture records (a CUDA capture computes nothing): replay it below
            while len(self.graphs) >= self.max_graphs:
                self.graphs.pop(next(iter(self.graphs)))  # its graph and buffers go with it
            cap = self._capture(staged.clone(), shapes)
        else:
            cap.inputs.copy_(staged, non_blocking=True)
        self.graphs[shapes] = cap  # most recently used last
        cap.replay()
        o = cap.out
        features = None if o.features is None else o.features.clone()
        return RowsRun(o.logits.clone(), o.topk_ties.clone(), o.hidden.clone(), features), cap.tables

    def _capture(self, inputs: torch.Tensor, shapes: StepShapes) -> _Captured:
        rt = self.runtime

        def step():
            tables = build_from(inputs, shapes, rt.device_pages, rt.layout)
            plan = VerifyPlan(**tables, rows=(), seq_lens=(), offsets=(), num_nodes=(), trees=())
            return tables, run_rows(self.model, plan, rt.pools, self.ops, feature_layers=self.feature_layers)

        replay, (tables, out) = self.capture(step)
        return _Captured(replay, inputs, tables, out)


def pad_rows(x: torch.Tensor, rows: int, dim: int = 0) -> torch.Tensor:
    """x with zeros appended along `dim` up to `rows` (a bucket's padding requests)."""
    pad = rows - x.shape[dim]
    if pad == 0:
        return x
    shape = list(x.shape)
    shape[dim] = pad
    return torch.cat([x, x.new_zeros(shape)], dim)


def pack_windows(rows: list, width: int, dim: int = 0) -> tuple:
    """Per-request windows (rows[b]: its w_b <= width rows along `dim`) back to back in slots of
    `width` rows, zeros after each: (tensor with B * width rows along dim, [w_b] on the host).
    A fixed shape for any mix of lengths: what a captured draft reads its windows from."""
    shape = list(rows[0].shape)
    shape[dim] = len(rows) * width
    out = rows[0].new_zeros(shape)
    lengths = []
    for b, x in enumerate(rows):
        w = x.shape[dim]
        if w > width:
            raise StateError(f"a window of {w} rows does not fit its slot of {width}")
        out.narrow(dim, b * width, w).copy_(x)
        lengths.append(w)
    return out, lengths


@dataclass
class _Bucket:
    replay: Callable
    inputs: tuple  # static inputs the graph reads
    out: object  # static outputs the graph writes


class BucketGraphs:
    """fn(key, *inputs) captured once per (bucket, key) and replayed: a drafter's device half
    (drafters/dspark_graphs.py, drafters/mtp_wave.py). The caller pads its inputs to the
    bucket's shapes (serving/buckets.pow2 requests; pad_rows, pack_windows) and takes the real rows of the static outputs, valid
    until that graph's next replay; key names what else selects the function's form. At most
    max_graphs graphs are held (the least recently replayed is released first)."""

    def __init__(self, fn: Callable, capture: Callable = cuda_capture, max_graphs: int = 8):
        self.fn, self.capture, self.max_graphs = fn, capture, max_graphs
        self.graphs: dict = {}  # (bucket, *key) -> _Bucket, least recently used first

    @torch.inference_mode()
    def run(self, bucket: int, inputs: tuple, key: tuple = ()):
        name = (bucket, *key)
        cap = self.graphs.pop(name, None)
        if cap is None:
            while len(self.graphs) >= self.max_graphs:
                self.graphs.pop(next(iter(self.graphs)))
            statics = tuple(x.clone() for x in inputs)  # this round's values: the warm-up's and capture's
            replay, out = self.capture(lambda: self.fn(key, *statics))
            cap = _Bucket(replay, statics, out)
        else:
            for static, new in zip(cap.inputs, inputs):
                static.copy_(new, non_blocking=True)
        self.graphs[name] = cap  # most recently used last
        cap.replay()
        return cap.out
