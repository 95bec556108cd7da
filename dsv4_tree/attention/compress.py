"""Branch compressed entries: pool each closing node's block from committed state + path rows."""
from __future__ import annotations

import torch

from ..cache.state import CompressorState
from .plan import CompressPlan


def gather_block_rows(state: CompressorState, new_kv, new_gate, cp: CompressPlan, bias):
    """Source rows of every closing node's entry, bias added. -> kv, gate [E, R, head_dim]
    (R = m for C128, 2m for C4: block w-1's first half, then block w's second half)."""
    d = state.head_dim
    table_kv = torch.cat([state.buffer_kv, new_kv])
    table_gate = torch.cat([state.buffer_gate, new_gate])
    kv = table_kv[cp.src]  # [E, m, ch]
    gate = table_gate[cp.src] + bias
    if not state.overlap:
        return kv, gate
    m = state.ratio
    stored_kv = state.overlap_kv if state.overlap_kv is not None else new_kv.new_zeros(m, d)
    stored_gate = state.overlap_gate if state.overlap_gate is not None else new_gate.new_zeros(m, d)
    a_kv = torch.cat([table_kv[:, :d], stored_kv, new_kv.new_zeros(1, d)])[cp.prev]
    a_gate = torch.cat([table_gate[:, :d], stored_gate, new_gate.new_full((1, d), float("-inf"))])[cp.prev]
    a_gate = a_gate + torch.where(cp.prev_stored.unsqueeze(-1), torch.zeros_like(bias[:, :d]), bias[:, :d])
    return torch.cat([a_kv, kv[..., d:]], dim=1), torch.cat([a_gate, gate[..., d:]], dim=1)


def branch_entries(state, new_kv, new_gate, cp: CompressPlan, module, rope_cs, apply_rope, pool):
    """Entries closed inside the tree, one per closing node (in cp.closing order). [E, head_dim]"""
    if cp.closing.numel() == 0:
        return new_kv.new_zeros((0, state.head_dim))
    kv, gate = gather_block_rows(state, new_kv, new_gate, cp, module.position_bias)
    cos, sin = rope_cs
    return pool(kv, gate, module.kv_norm, cos, sin, apply_rope)
