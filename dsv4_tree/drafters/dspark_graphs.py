"""A DSpark draft's device half at a fixed shape, captured per batch bucket.

Once every request's context holds the target's features (`bring_up`: eager, its rows per
request vary with what the last round accepted), a greedy draft of a fixed size is a function of
four tensors: the anchors [B], their positions [B], the contexts padded to the window
[S, B * W, head_dim] (`pack_contexts`) and their lengths [B]. `fixed_draft` computes the round's
TreeBatch from them: one backbone pass, then the Markov walk (a chain) or the Markov expansion
and organize_draft_results' pick (a tree), every shape fixed by (B, W, the tree shape) and no
host read (tests/test_dspark_graphs.py runs it under forbid_host_sync and on the meta device).

`DraftGraphs` captures that function once per bucket (B rounded up to a power of two; padding
requests have no context and an anchor of 0, their rows attend to their own block only and
their trees are dropped) and replays it: the inputs are copied into the bucket's static
buffers, the graph replays, the real rows of its TreeBatch are cloned out. What stays eager:
bring_up, the packing, and the one host read of the trees. A budgeted or drawn draft is not
captured (its budget and value model change on the host between rounds, its draws need the
generator's uniforms): it runs the same padded forward eagerly."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..executor.graphs import cuda_capture
from ..tree.build import local_parents, organize_draft_results
from ..tree.tree_batch import TreeBatch
from .dspark_rows import block_ids, block_rows, markov_walk, padded_block_index
from .dspark_tree import expand_markov

MAX_GRAPHS = 8  # captured draft buckets kept at once (least recently used dropped first)


def padded_block(model, module, anchors: torch.Tensor, starts: torch.Tensor, tables: torch.Tensor,
                 lengths: torch.Tensor, width: int):
    """The backbone pass over contexts padded to `width` rows (pack_contexts) -> DSparkBlock."""
    index = padded_block_index(lengths, module.settings.block_rows, width)
    return block_rows(model, module, block_ids(module, anchors), starts, tables, index)


def fixed_tree(module, blk, anchors: torch.Tensor, shape, branching: str, temperatures=None, keep_logits=False):
    """The Markov tree of num_draft_tokens nodes of every request -> (TreeBatch, the expansion,
    organize_draft_results' pick)."""
    exp = expand_markov(module, blk, anchors, shape.topk, shape.num_steps, branching, keep_logits=keep_logits,
                        temperatures=temperatures)
    pool = sum(x[0].numel() for x in exp.score_list)
    org = organize_draft_results(exp.score_list, exp.token_list, exp.parents_list, min(shape.num_draft_tokens, pool + 1))
    local = local_parents(org.parent_list, org.top_scores_index, shape.topk, check=False)  # connected by construction
    return TreeBatch(torch.cat([anchors.unsqueeze(1), org.draft_tokens], 1), local), exp, org


def fixed_draft(model, module, shape, branching: str, temperatures, width: int, anchors: torch.Tensor,
                starts: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor) -> TreeBatch:
    """A greedy draft of a fixed size, from its four input tensors (module docstring)."""
    blk = padded_block(model, module, anchors, starts, tables, lengths, width)
    if shape.topk == 1:
        batch = TreeBatch.chains(markov_walk(module, blk, anchors)[0])
    else:
        batch = fixed_tree(module, blk, anchors, shape, branching, temperatures)[0]
    return TreeBatch(batch.tokens.contiguous(), batch.parents.contiguous())  # own memory: a graph's static outputs


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@dataclass
class _Captured:
    replay: Callable
    anchors: torch.Tensor  # [Bp] static inputs the graph reads
    starts: torch.Tensor
    tables: torch.Tensor  # [S, Bp * W, head_dim]
    lengths: torch.Tensor
    out: TreeBatch  # static outputs the graph writes


class DraftGraphs:
    """fn(anchors, starts, tables, lengths) -> TreeBatch, captured per bucket of requests; at most
    max_graphs buckets are held (the least recently replayed is released first)."""

    def __init__(self, fn: Callable, width: int, capture: Callable = cuda_capture, max_graphs: int = MAX_GRAPHS):
        self.fn, self.width, self.capture, self.max_graphs = fn, width, capture, max_graphs
        self.graphs: dict = {}  # padded batch -> _Captured, least recently used first

    @staticmethod
    def bucket(b: int) -> int:
        return _pow2(b)

    @torch.inference_mode()
    def run(self, anchors: torch.Tensor, starts: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor) -> TreeBatch:
        b = anchors.shape[0]
        bp = self.bucket(b)
        cap = self.graphs.pop(bp, None)
        if cap is None:
            while len(self.graphs) >= self.max_graphs:
                self.graphs.pop(next(iter(self.graphs)))
            cap = self._capture(bp, tables)
        cap.anchors.zero_()
        cap.starts.zero_()
        cap.lengths.zero_()  # padding requests: no context
        cap.anchors[:b].copy_(anchors, non_blocking=True)
        cap.starts[:b].copy_(starts, non_blocking=True)
        cap.lengths[:b].copy_(lengths, non_blocking=True)
        cap.tables[:, : b * self.width].copy_(tables, non_blocking=True)
        self.graphs[bp] = cap  # most recently used last
        cap.replay()
        return TreeBatch(cap.out.tokens[:b].clone(), cap.out.parents[:b].clone())

    def _capture(self, bp: int, like: torch.Tensor) -> _Captured:
        dev = like.device
        anchors = torch.zeros(bp, dtype=torch.int64, device=dev)
        starts = torch.zeros(bp, dtype=torch.int64, device=dev)
        lengths = torch.zeros(bp, dtype=torch.int64, device=dev)
        tables = like.new_zeros(like.shape[0], bp * self.width, like.shape[2])
        replay, out = self.capture(lambda: self.fn(anchors, starts, tables, lengths))
        return _Captured(replay, anchors, starts, tables, lengths, out)
