"""The commit mapper: fold one accepted path of a verify into a request's committed cache.

Everything is computed first into fresh tensors (commit_plan), then swapped in (apply), so a
failure while computing leaves the committed cache untouched. Rows and entries of rejected
nodes are simply never copied: nothing reachable from the cache depends on them."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention.plan import CompressPlan, RequestPlan
from ..cache.state import CompressorState, LayerCache, RequestCache


@dataclass
class CompressorUpdate:
    entries: torch.Tensor  # [new entries, head_dim] appended in block order
    buffer_kv: torch.Tensor  # [P' - n_e'*m, channels]
    buffer_gate: torch.Tensor
    overlap_kv: torch.Tensor | None  # replaced only when a block closed
    overlap_gate: torch.Tensor | None


@dataclass
class LayerUpdate:
    window: torch.Tensor  # [min(P', W), head_dim]
    main: CompressorUpdate | None
    indexer: CompressorUpdate | None


def _compressor_update(state: CompressorState, rows, b: int, cp: CompressPlan, path: torch.Tensor,
                       seq_len: int, bias: torch.Tensor, row_slice: slice) -> CompressorUpdate:
    m, n_e, r = state.ratio, cp.committed, cp.buffered
    new_len = seq_len + path.numel()
    n_e2 = new_len // m
    owned = cp.entry_of_node[path]
    owned = owned[owned >= 0]
    if owned.numel() != n_e2 - n_e:
        raise AssertionError(f"commit closes {owned.numel()} blocks, expected {n_e2 - n_e}")
    entries = rows.entries[b][owned.to(rows.entries[b].device, non_blocking=True)]
    table_kv = torch.cat([state.buffer_kv, rows.kv[row_slice]])
    table_gate = torch.cat([state.buffer_gate, rows.gate[row_slice]])

    def table_ids(q: torch.Tensor) -> torch.Tensor:
        return torch.where(q < seq_len, q - n_e * m, r + path[(q - seq_len).clamp(min=0)])

    dev = table_kv.device
    keep = table_ids(torch.arange(n_e2 * m, new_len)).to(dev, non_blocking=True)
    ov_kv, ov_gate = state.overlap_kv, state.overlap_gate
    if state.overlap and n_e2 > n_e:
        last = table_ids(torch.arange((n_e2 - 1) * m, n_e2 * m)).to(dev, non_blocking=True)
        d = state.head_dim
        ov_kv = table_kv[last][:, :d].clone()
        ov_gate = (table_gate[last] + bias)[:, :d].clone()
    return CompressorUpdate(entries, table_kv[keep].clone(), table_gate[keep].clone(), ov_kv, ov_gate)


@torch.no_grad()
def commit_plan(model, cache: RequestCache, run_layers, b: int, rp: RequestPlan, path: torch.Tensor) -> list:
    """Compute the new per-layer state after accepting `path` (node ids, root first).

    rp and path are host bookkeeping (CPU); only index tensors travel to the cache's device."""
    rows = slice(rp.row_offset, rp.row_offset + rp.num_nodes)
    window = model.window
    updates = []
    for li, (lc, lr) in enumerate(zip(cache.layers, run_layers)):
        comp = model.hf.model.layers[li].self_attn.compressor
        new_raw = lr.raw[rows][path.to(lr.raw.device, non_blocking=True)]
        win = torch.cat([lc.window, new_raw])[-window:].clone()
        main = index = None
        if lc.main is not None:
            cp = rp.compress[lc.main.ratio]
            main = _compressor_update(lc.main, lr.main, b, cp, path, rp.seq_len, comp.position_bias, rows)
        if lc.indexer is not None:
            cp = rp.compress[lc.indexer.ratio]
            index = _compressor_update(lc.indexer, lr.indexer, b, cp, path, rp.seq_len,
                                       comp.indexer.position_bias, rows)
        updates.append(LayerUpdate(win, main, index))
    return updates


def _apply_compressor(state: CompressorState, u: CompressorUpdate) -> None:
    state.entries.append(u.entries)
    state.buffer_kv, state.buffer_gate = u.buffer_kv, u.buffer_gate
    state.overlap_kv, state.overlap_gate = u.overlap_kv, u.overlap_gate


def apply(cache: RequestCache, updates: list, new_len: int) -> None:
    """Swap the computed state in (cannot fail on valid updates)."""
    for lc, u in zip(cache.layers, updates):
        lc.window = u.window
        if u.main is not None:
            _apply_compressor(lc.main, u.main)
        if u.indexer is not None:
            _apply_compressor(lc.indexer, u.indexer)
    cache.seq_len = new_len


def layer_summary(lc: LayerCache) -> dict:
    """Flat view of one layer's committed state (for equality checks and debugging)."""
    out = {"window": lc.window}
    for name, st in (("main", lc.main), ("indexer", lc.indexer)):
        if st is None:
            continue
        out[f"{name}.entries"] = st.entries.rows
        out[f"{name}.buffer_kv"] = st.buffer_kv
        out[f"{name}.buffer_gate"] = st.buffer_gate
        out[f"{name}.entry_count"] = torch.tensor(st.entry_count)
        if st.overlap_kv is not None:
            out[f"{name}.overlap_kv"] = st.overlap_kv
            out[f"{name}.overlap_gate"] = st.overlap_gate
    return out
