"""Tree masks in SGLang's three layouts, all derived from the ancestor relation."""
from __future__ import annotations

import enum

import torch

from ..errors import TreeError


class TreeMaskMode(enum.IntEnum):
    """Same members and meaning as SGLang's TreeMaskMode."""

    FULL_MASK = 0  # per request: N rows of (seq_len + N) booleans, prefix columns true
    QLEN_ONLY = 1  # per request: N x N booleans
    QLEN_ONLY_BITPACKING = 2  # per row: one unsigned int, bit j set when the row sees node j


BITPACK_DTYPES = ((8, torch.uint8), (16, torch.uint16), (32, torch.uint32))


def bitpack_dtype(num_nodes: int) -> torch.dtype:
    for bits, dtype in BITPACK_DTYPES:
        if num_nodes <= bits:
            return dtype
    raise TreeError(f"QLEN_ONLY_BITPACKING holds at most 32 nodes per row, got num_draft_tokens={num_nodes}")


def make_tree_mask(ancestors: torch.Tensor, seq_lens: torch.Tensor, mode: TreeMaskMode) -> torch.Tensor:
    """ancestors: [bs, N, N] bool (row sees column); seq_lens: [bs].

    FULL_MASK -> flat bool [sum_b N * (seq_len_b + N)]; QLEN_ONLY -> flat bool [bs * N * N];
    QLEN_ONLY_BITPACKING -> [bs * N] uint8/uint16/uint32."""
    mode = TreeMaskMode(mode)
    bs, n, _ = ancestors.shape
    if mode == TreeMaskMode.QLEN_ONLY:
        return ancestors.reshape(-1).clone()
    if mode == TreeMaskMode.QLEN_ONLY_BITPACKING:
        dtype = bitpack_dtype(n)
        weights = torch.ones(n, dtype=torch.int64, device=ancestors.device) << torch.arange(n, device=ancestors.device)
        packed = (ancestors.long() * weights).sum(-1).reshape(-1)
        return packed.to(dtype)
    parts = []
    for b in range(bs):
        prefix = torch.ones(n, int(seq_lens[b]), dtype=torch.bool, device=ancestors.device)
        parts.append(torch.cat([prefix, ancestors[b]], dim=1).reshape(-1))
    return torch.cat(parts)


def unpack_bits(packed: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """Inverse of the bit packing: [rows] unsigned -> [rows, num_nodes] bool."""
    bits = torch.arange(num_nodes, device=packed.device)
    return ((packed.long().unsqueeze(-1) >> bits) & 1).bool()
