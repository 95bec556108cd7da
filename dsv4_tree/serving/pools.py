"""Per-layer pools of one model: storage only (slots and bytes; no requests, no trees).

Per layer: `swa` (raw K=V rows, recent slots), and per compressor (a C4 layer's main
compressor and indexer, a C128 layer's compressor) its projected kv/gate rows (recent slots,
model dtype, gate without position bias) and its entry pool (pooled entries, or indexer keys).
Entry pools hold committed entries at slots derived from token slots (`Layout.entry_slot`)
followed by per-request scratch slots for the entries a verify closes inside its trees."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .kv_pool import KVPool


@dataclass(frozen=True)
class Layout:
    """Address arithmetic shared by tables, layers and commit (pure ints)."""

    page_size: int
    window: int  # W
    recent_window: int  # R: positions before P a future row may still read (window, compressor rows)
    ratios: dict  # ratio -> overlap (C4 style) bool
    num_token_pages: int
    scratch_per_request: int  # S: entry scratch slots per request row (>= nodes per call)
    max_requests: int
    num_recent_pages: int

    @property
    def trash_recent_slot(self) -> int:
        """One recent slot past every page: padded rows of a static-shape batch write here."""
        return self.num_recent_pages * self.page_size

    def trash_entry_slot(self, ratio: int) -> int:
        """One entry slot past the scratch region: padded closing rows write their entry here."""
        return self.committed_entry_slots(ratio) + self.max_requests * self.scratch_per_request

    def entries_per_page(self, ratio: int) -> int:
        return max(1, self.page_size // ratio)

    def committed_entry_slots(self, ratio: int) -> int:
        return self.num_token_pages * self.entries_per_page(ratio)

    def entry_slot(self, ratio: int, token_slot: torch.Tensor) -> torch.Tensor:
        """Entry slot of the block whose first position has `token_slot` (SGLang's slot // ratio
        when page_size % ratio == 0; one entry per page when the block spans pages)."""
        ps = self.page_size
        return (token_slot // ps) * self.entries_per_page(ratio) + (token_slot % ps) // ratio

    def scratch_slot(self, ratio: int, row: torch.Tensor, node: torch.Tensor) -> torch.Tensor:
        return self.committed_entry_slots(ratio) + row * self.scratch_per_request + node


@dataclass
class CompressorPools:
    ratio: int
    overlap: bool
    head_dim: int
    rows_kv: torch.Tensor  # [recent slots, channels] projected rows (model dtype)
    rows_gate: torch.Tensor  # [recent slots, channels] gate logits without position bias
    entries: KVPool  # [entry slots + scratch, head_dim]

    def write_rows(self, slots: torch.Tensor, kv: torch.Tensor, gate: torch.Tensor) -> None:
        self.rows_kv.index_copy_(0, slots, kv)
        self.rows_gate.index_copy_(0, slots, gate)

    def copy_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.rows_kv.index_copy_(0, dst, self.rows_kv[src])
        self.rows_gate.index_copy_(0, dst, self.rows_gate[src])


@dataclass
class LayerPools:
    swa: KVPool  # [recent slots, head_dim]
    main: CompressorPools | None = None
    indexer: CompressorPools | None = None

    @property
    def compressors(self) -> tuple:
        return tuple(c for c in (self.main, self.indexer) if c is not None)


@dataclass(frozen=True)
class CompressorShape:
    """What storage needs of one compressor: plain numbers (the model side reads its modules)."""

    ratio: int
    overlap: bool  # C4 style: overlapping windows, kv / gate rows twice head_dim wide
    head_dim: int


@dataclass(frozen=True)
class LayerShape:
    head_dim: int  # K=V row width
    main: CompressorShape | None = None
    indexer: CompressorShape | None = None  # the C4 indexer's key compressor


def build_pools(layers: list, rope_dim: int, layout: Layout, kv_dtype: str, device, dtype) -> list:
    """Zeroed pools for layers (one LayerShape each) on `device`, rows in `dtype`."""
    ps = layout.page_size
    recent = layout.trash_recent_slot + 1

    def compressor(shape: CompressorShape, kind: str) -> CompressorPools:
        width = 2 * shape.head_dim if shape.overlap else shape.head_dim
        n_ent = layout.trash_entry_slot(shape.ratio) + 1
        entries = KVPool(n_ent, shape.head_dim, rope_dim if kind == "kv" else 0, kv_dtype, ps, device, dtype, kind=kind)
        return CompressorPools(shape.ratio, shape.overlap, shape.head_dim,
                               torch.zeros(recent, width, dtype=dtype, device=device),
                               torch.zeros(recent, width, dtype=dtype, device=device), entries)

    return [LayerPools(KVPool(recent, shape.head_dim, rope_dim, kv_dtype, ps, device, dtype),
                       compressor(shape.main, "kv") if shape.main is not None else None,
                       compressor(shape.indexer, "index_key") if shape.indexer is not None else None)
            for shape in layers]
