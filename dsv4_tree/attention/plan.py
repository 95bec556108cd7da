"""The verify plan: built once per verify call from host bookkeeping, read by every layer.

For each request it fixes, as index tensors: node positions, each row's sliding-window key
list, and per compression ratio which nodes close which blocks, where each closing node's
source rows come from (committed buffer / stored overlap / path rows) and which branch
entries each row may see. Nothing here depends on a layer's weights."""
from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass, replace

import torch

from ..tree.draft_tree import DraftTree


def _to(obj, device):
    """`obj` with every tensor on `device`: a tensor, a dict or tuple of plan parts, or a plan
    dataclass (field by field; trees and ints stay on the host). Host-to-device copies are
    issued non-blocking: the host never waits for them."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, dict):
        return {k: _to(x, device) for k, x in obj.items()}
    if isinstance(obj, tuple):
        return tuple(_to(x, device) for x in obj)
    if not is_dataclass(obj) or isinstance(obj, DraftTree):
        return obj
    return replace(obj, **{f.name: _to(getattr(obj, f.name), device) for f in fields(obj)})


@dataclass(frozen=True)
class CompressPlan:
    """One request, one compression ratio m. Source tables per compressor (same for all layers):
    src table  = cat[buffer rows (r = P - n_e*m), new rows (N)]
    prev table = cat[src table, stored overlap rows (m), null row (1)]   (overlap compressors)"""

    ratio: int  # m
    committed: int  # n_e = P // m committed entries, visible to every row
    buffered: int  # r = P - n_e*m committed rows of the block in progress
    closing: torch.Tensor  # [E] node ids that close a block, ascending
    blocks: torch.Tensor  # [E] block index w of each closing node
    src: torch.Tensor  # [E, m] rows of block w in the src table
    prev: torch.Tensor  # [E, m] rows of block w-1 in the prev table
    prev_stored: torch.Tensor  # [E, m] True where prev reads stored overlap / null (no bias to add)
    visible: torch.Tensor  # [N, D+1] branch entry ids on path(i) in block order, -1 = none
    entry_of_node: torch.Tensor  # [N] branch entry closed by node i, -1 = none


@dataclass(frozen=True)
class RequestPlan:
    seq_len: int  # P
    num_nodes: int  # N
    row_offset: int  # first packed row of this request
    tree: DraftTree
    positions: torch.Tensor  # [N] P + depth
    window_len: int  # Lw = min(P, W) committed window rows
    swa_index: torch.Tensor  # [N, W] into cat[window (Lw), new rows (N)]; -1 before position 0
    compress: dict  # ratio (int) -> CompressPlan
    # ratio -> [N, W + D+1]: swa_index, then the row's branch entries as ids into the local
    # table cat[window, new rows, branch entries] (-1 = none); what layers without an indexer read
    swa_branch_index: dict

    @property
    def local_offset(self) -> int:
        """Where branch entries start in the local table cat[window, new rows, entries]."""
        return self.window_len + self.num_nodes


@dataclass(frozen=True)
class VerifyPlan:
    requests: tuple  # RequestPlan per request
    positions: torch.Tensor  # [T] packed row positions
    input_ids: torch.Tensor  # [T] packed row tokens
    num_rows: int  # T

    def to(self, device) -> "VerifyPlan":
        """The plan with its index tensors on the model's device (one copy per verify)."""
        return self if torch.device(device).type == "cpu" else _to(self, device)


def _table_rows(q: torch.Tensor, seq_len: int, base: int, committed_offset: int, path: torch.Tensor, rows: torch.Tensor):
    """Map absolute positions q (< P: committed buffer row q - base; >= P: path node row) to table ids."""
    depth = (q - seq_len).clamp(min=0, max=path.shape[1] - 1)
    node = path[rows.unsqueeze(1).expand_as(q), depth]
    return torch.where(q < seq_len, q - base, committed_offset + node)


def plan_compress(tree: DraftTree, seq_len: int, ratio: int) -> CompressPlan:
    n_e = seq_len // ratio
    r = seq_len - n_e * ratio
    n = tree.num_nodes
    pos = tree.positions(seq_len)
    closes = (pos + 1) % ratio == 0
    closing = closes.nonzero().flatten()
    blocks = (pos[closing] + 1) // ratio - 1
    j = torch.arange(ratio)
    q = blocks.unsqueeze(1) * ratio + j  # [E, m]
    src = _table_rows(q, seq_len, n_e * ratio, r, tree.path, closing)
    qp = q - ratio
    in_table = (blocks >= n_e + 1).unsqueeze(1).expand_as(qp)  # block w-1 lies at/after n_e
    stored_slot = torch.where(blocks.unsqueeze(1) >= 1, r + n + j, torch.full_like(qp, r + n + ratio))
    prev_rows = _table_rows(qp.clamp(min=0), seq_len, n_e * ratio, r, tree.path, closing)
    prev = torch.where(in_table, prev_rows, stored_slot)
    entry_of_node = torch.full((n,), -1, dtype=torch.int64)
    entry_of_node[closing] = torch.arange(closing.numel())
    path = tree.path
    visible = torch.where(path >= 0, entry_of_node[path.clamp(min=0)], torch.full_like(path, -1))
    return CompressPlan(ratio, n_e, r, closing, blocks, src, prev, ~in_table, visible, entry_of_node)


def plan_request(tree: DraftTree, seq_len: int, row_offset: int, window: int, ratios) -> RequestPlan:
    n = tree.num_nodes
    lw = min(seq_len, window)
    pos = tree.positions(seq_len)
    q = pos.unsqueeze(1) - window + 1 + torch.arange(window)  # [N, W]
    valid = q >= 0
    rows = torch.arange(n)
    idx = _table_rows(q.clamp(min=0), seq_len, seq_len - lw, lw, tree.path, rows)
    idx = torch.where(valid, idx, torch.full_like(idx, -1))
    compress = {m: plan_compress(tree, seq_len, m) for m in sorted(set(ratios))}
    swa_branch = {
        m: torch.cat([idx, torch.where(cp.visible >= 0, lw + n + cp.visible, torch.full_like(cp.visible, -1))], 1)
        for m, cp in compress.items()
    }
    return RequestPlan(seq_len, n, row_offset, tree, pos, lw, idx, compress, swa_branch)


def build_plan(trees, seq_lens, window: int, ratios) -> VerifyPlan:
    plans, offset = [], 0
    for tree, seq_len in zip(trees, seq_lens):
        plans.append(plan_request(tree, int(seq_len), offset, window, ratios))
        offset += tree.num_nodes
    positions = torch.cat([p.positions for p in plans])
    input_ids = torch.cat([t.tokens for t in trees])
    return VerifyPlan(tuple(plans), positions, input_ids, offset)
