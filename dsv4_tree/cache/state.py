"""Committed per-request cache: raw sliding-window KV, compressed entries, compressor state.

Layout follows Hugging Face's DeepseekV4 cache fields so states can be compared directly:
  buffer_kv / buffer_gate : projected rows of the block in progress (positions >= n_e*m,
                            < P), gate without position bias;      [P - n_e*m, channels]
  overlap_kv / overlap_gate: overlap compressors only: the first-half channels of the last
                            full block's rows, gate WITH position bias;     [m, head_dim]
  entries                 : pooled, normed, roped compressed entries;  [n_e, head_dim]
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


class GrowBuffer:
    """Append-only row buffer with amortised O(1) appends (capacity doubling)."""

    def __init__(self, width: int, dtype: torch.dtype, device: torch.device, capacity: int = 16):
        self._data = torch.empty(max(capacity, 1), width, dtype=dtype, device=device)
        self._len = 0

    @property
    def rows(self) -> torch.Tensor:
        """A view of the filled rows. [len, width]"""
        return self._data[: self._len]

    def __len__(self) -> int:
        return self._len

    def append(self, rows: torch.Tensor) -> None:
        need = self._len + rows.shape[0]
        if need > self._data.shape[0]:
            cap = max(need, 2 * self._data.shape[0])
            new = torch.empty(cap, self._data.shape[1], dtype=self._data.dtype, device=self._data.device)
            new[: self._len] = self._data[: self._len]
            self._data = new
        self._data[self._len : need] = rows
        self._len = need

    def clone(self) -> "GrowBuffer":
        out = GrowBuffer(self._data.shape[1], self._data.dtype, self._data.device, self._len)
        out.append(self.rows)
        return out


@dataclass
class CompressorState:
    """State of one compressor (a layer's main compressor, or a C4 layer's indexer)."""

    ratio: int  # m
    head_dim: int  # width of one pooled entry
    overlap: bool  # C4-style overlapping windows (projections are 2*head_dim wide)
    entries: GrowBuffer  # [n_e, head_dim]
    buffer_kv: torch.Tensor  # [P - n_e*m, channels]
    buffer_gate: torch.Tensor  # [P - n_e*m, channels]
    overlap_kv: torch.Tensor | None = None  # [m, head_dim] or None before the first block
    overlap_gate: torch.Tensor | None = None  # [m, head_dim]

    @property
    def channels(self) -> int:
        return 2 * self.head_dim if self.overlap else self.head_dim

    @property
    def entry_count(self) -> int:
        return len(self.entries)

    @classmethod
    def empty(cls, ratio: int, head_dim: int, overlap: bool, dtype, device) -> "CompressorState":
        ch = 2 * head_dim if overlap else head_dim
        return cls(
            ratio=ratio,
            head_dim=head_dim,
            overlap=overlap,
            entries=GrowBuffer(head_dim, dtype, device),
            buffer_kv=torch.empty(0, ch, dtype=dtype, device=device),
            buffer_gate=torch.empty(0, ch, dtype=dtype, device=device),
        )

    def clone(self) -> "CompressorState":
        return CompressorState(
            self.ratio, self.head_dim, self.overlap, self.entries.clone(), self.buffer_kv.clone(),
            self.buffer_gate.clone(),
            None if self.overlap_kv is None else self.overlap_kv.clone(),
            None if self.overlap_gate is None else self.overlap_gate.clone(),
        )


@dataclass
class LayerCache:
    """One layer's committed cache for one request."""

    window: torch.Tensor  # [min(P, W), head_dim] raw K=V rows of the last W positions
    main: CompressorState | None = None  # C4 or C128 compressor; None on sliding layers
    indexer: CompressorState | None = None  # C4 layers only

    def clone(self) -> "LayerCache":
        return LayerCache(
            self.window.clone(),
            None if self.main is None else self.main.clone(),
            None if self.indexer is None else self.indexer.clone(),
        )


@dataclass
class RequestCache:
    """All layers of one request; seq_len is P (committed, KV-ready positions)."""

    seq_len: int
    layers: list[LayerCache] = field(default_factory=list)

    def clone(self) -> "RequestCache":
        return RequestCache(self.seq_len, [layer.clone() for layer in self.layers])
