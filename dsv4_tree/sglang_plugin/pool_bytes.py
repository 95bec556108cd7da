"""Byte-level access to SGLang 0.5.23's DeepSeek-V4 pools, and an undo log that makes a commit
all-or-nothing. Knows slots and bytes, not trees.

SGLang's paged records are stored in two pieces per page (`kv_layout.py`, `KVLayout.V4`): every
slot's data bytes first (slot i at `i * data_bytes`), then every slot's scale bytes (slot i at
`page_size * data_bytes + i * scale_bytes`). V4 K=V records (SWA, C4, C128 pools): 576 data
bytes (448 e4m3 + 64 bf16) and 8 scale bytes (7 ue8m0 + 1 pad); C4 indexer keys: 128 e4m3 bytes
and one fp32 scale (4 bytes). A compressor state ring is a plain `[rows, last_dim]` tensor.

A `Pieces` names, for one buffer, the flat elements of each slot's record; moving records is
then one gather and one scatter per piece, whatever the layout."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import StateError

V4_DATA_BYTES, V4_SCALE_BYTES = 576, 8
INDEX_K_DATA_BYTES, INDEX_K_SCALE_BYTES = 128, 4


@dataclass(frozen=True)
class PagedRecords:
    """One paged record buffer `[num_pages, page_bytes]` uint8 (one layer of one SGLang pool)."""
    buffer: torch.Tensor  # [num_pages, page_bytes] uint8
    page_size: int
    data_bytes: int
    scale_bytes: int

    def __post_init__(self):
        pages, page_bytes = self.buffer.shape
        if self.buffer.dtype != torch.uint8 or page_bytes < self.page_size * (self.data_bytes + self.scale_bytes):
            raise StateError(f"paged record buffer {tuple(self.buffer.shape)} {self.buffer.dtype} cannot hold "
                             f"{self.page_size} records of {self.data_bytes} + {self.scale_bytes} bytes per page")

    @property
    def capacity(self) -> int:
        return self.buffer.shape[0] * self.page_size

    def element_index(self, slots: torch.Tensor) -> torch.Tensor:
        """slots [n] -> [n, data_bytes + scale_bytes] int64 flat byte offsets of each slot's record
        (data piece, then scale piece)."""
        slots = slots.to(torch.int64).view(-1, 1)
        page, off = slots // self.page_size, slots % self.page_size
        base = page * self.buffer.shape[1]
        dev = self.buffer.device
        data = base + off * self.data_bytes + torch.arange(self.data_bytes, device=dev)
        scale = (base + self.page_size * self.data_bytes + off * self.scale_bytes
                 + torch.arange(self.scale_bytes, device=dev))
        return torch.cat([data, scale], dim=1)

    def flat(self) -> torch.Tensor:
        return self.buffer.view(-1)

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """-> [n, data_bytes + scale_bytes] uint8: the records' bytes (a copy)."""
        return self.flat()[self.element_index(slots)]


@dataclass(frozen=True)
class StateRows:
    """One compressor state ring `[rows, last_dim]` (SGLang's `kv_score_buffer.kv_score`)."""
    buffer: torch.Tensor  # [rows, last_dim] float

    def element_index(self, rows: torch.Tensor) -> torch.Tensor:
        rows = rows.to(torch.int64).view(-1, 1)
        width = self.buffer.shape[1]
        return rows * width + torch.arange(width, device=self.buffer.device)

    def flat(self) -> torch.Tensor:
        return self.buffer.view(-1)


@dataclass
class UndoLog:
    """The bytes every write of a commit replaced, in write order; `rollback` puts them back in
    reverse order, so the buffers end exactly as before the first write."""
    entries: list = field(default_factory=list)

    def write(self, flat: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
        if index.numel() == 0:
            return
        self.entries.append((flat, index, flat[index].clone()))
        flat[index] = values

    def rollback(self) -> None:
        for flat, index, before in reversed(self.entries):
            flat[index] = before
        self.entries.clear()


def move_records(log: UndoLog, target, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy the records (or state rows) at `src` [n] over those at `dst` [n] of one buffer
    (`PagedRecords` or `StateRows`), bit for bit. All sources are read before any write, so
    moves whose sources and destinations overlap (a path shifting down by one) are safe."""
    if src.numel() == 0:
        return
    flat = target.flat()
    values = flat[target.element_index(src)]
    log.write(flat, target.element_index(dst), values)
