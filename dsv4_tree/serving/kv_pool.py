"""One pool of per-token rows (K=V rows, compressed entries or indexer keys): slots and bytes.

A slot is an integer in [0, num_slots); page `slot // page_size` holds it at offset
`slot % page_size`. The pool knows nothing of requests, positions or trees. Every method is a
pure tensor op on the pool's device: no `.item()`, `.tolist()` or `nonzero` on device data, so
they can run inside the model forward without synchronising the host. Slot ranges in
write/copy/record_bytes are the caller's guarantee (no per-call check on device values).

Storage per `kv_dtype`:
* "auto": `[num_slots, head_dim]` in `compute_dtype`, exact;
* "bfloat16": `[num_slots, head_dim]` bfloat16 (round-to-nearest-even on write);
* "fp8_e4m3": uint8 `[num_pages, page_bytes]`, FP8 records (`records.py`): kind "kv" uses the
  DeepSeek-V4 KV record, kind "index_key" the indexer-key record (all channels e4m3, one float32
  scale per 128 values; `rope_dim` plays no part there). Per page, every token's data record
  first, then every token's scale record."""
from __future__ import annotations

import torch

from ..config import KV_CACHE_DTYPES
from ..errors import ConfigError, InputError
from ..numerics.casts import as_dtype
from .records import IndexKeyLayout, RecordLayout, dequantize_rows, quantize_rows

POOL_KINDS = ("kv", "index_key")


class KVPool:
    def __init__(self, num_slots: int, head_dim: int, rope_dim: int, kv_dtype: str, page_size: int,
                 device, compute_dtype: torch.dtype, kind: str = "kv"):
        if kv_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype={kv_dtype!r} is not one of {KV_CACHE_DTYPES}")
        if kind not in POOL_KINDS:
            raise ConfigError(f"KVPool kind={kind!r} is not one of {POOL_KINDS}")
        if num_slots <= 0 or page_size <= 0:
            raise ConfigError(f"KVPool needs num_slots > 0 and page_size > 0, got {num_slots=} {page_size=}")
        if not 0 <= rope_dim < head_dim:
            raise ConfigError(f"KVPool needs 0 <= rope_dim < head_dim, got {rope_dim=} {head_dim=}")
        if not compute_dtype.is_floating_point:
            raise ConfigError(f"KVPool compute_dtype must be a float dtype, got {compute_dtype}")
        self.num_slots, self.head_dim, self.rope_dim = num_slots, head_dim, rope_dim
        self.page_size, self.kv_dtype, self.kind = page_size, kv_dtype, kind
        self.compute_dtype = compute_dtype
        self.device = torch.device(device)
        self._store = None  # (pool, slots, rows) -> None: the write as one kernel (use_kernels)
        self.num_pages = -(-num_slots // page_size)
        self.record: RecordLayout | IndexKeyLayout | None = None  # the FP8 record format (FP8 pools only)
        if kv_dtype == "fp8_e4m3":
            self.record = RecordLayout(head_dim, rope_dim) if kind == "kv" else IndexKeyLayout(head_dim)
            self.page_bytes = self.record.page_bytes(page_size)
            self.bytes_per_token = self.record.bytes_per_token
            self.storage = torch.zeros(self.num_pages, self.page_bytes, dtype=torch.uint8, device=self.device)
        else:
            dtype = compute_dtype if kv_dtype == "auto" else torch.bfloat16
            self.storage = torch.zeros(num_slots, head_dim, dtype=dtype, device=self.device)
            self.bytes_per_token = head_dim * self.storage.element_size()
            self.page_bytes = page_size * self.bytes_per_token

    def use_kernels(self, fp8_store) -> None:
        """The Triton backend: an FP8 pool quantises and stores each write in one kernel
        (`fp8_store`: kernels/fp8_store.py, byte-equal to the torch writer); other pools keep
        their writes."""
        if self.record is not None:
            self._store = fp8_store

    def __repr__(self) -> str:
        return (f"KVPool(kind={self.kind!r}, kv_dtype={self.kv_dtype!r}, num_slots={self.num_slots}, "
                f"head_dim={self.head_dim}, rope_dim={self.rope_dim}, page_size={self.page_size}, "
                f"bytes_per_token={self.bytes_per_token})")

    def write(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """slots int64 [n], rows [n, head_dim] float: store (quantising in FP8 pools)."""
        if slots.dim() != 1 or rows.shape != (slots.shape[0], self.head_dim):
            raise InputError(f"KVPool.write needs slots [n] and rows [n, {self.head_dim}], "
                             f"got slots {tuple(slots.shape)} rows {tuple(rows.shape)}")
        if self.record is None:
            self.storage[slots] = rows.to(self.storage.dtype)
        elif self._store is not None:
            self._store(self, slots.to(torch.int64), rows)
        else:
            self._scatter(slots, *quantize_rows(rows, self.record))

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """slots int [...] -> rows [..., head_dim] in compute_dtype; slot -1 reads as zeros."""
        flat = slots.reshape(-1)
        safe = flat.clamp_min(0)
        if self.record is None:
            rows = as_dtype(self.storage[safe], self.compute_dtype)
        else:
            rows = dequantize_rows(*self._gather(safe), self.record, self.compute_dtype)
        rows.masked_fill_((flat < 0).unsqueeze(1), 0)  # rows is a fresh tensor (never the storage): fill in place
        return rows.view(*slots.shape, self.head_dim)

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Bitwise record moves src[k] -> dst[k] (data and scales); every read happens before any write."""
        if src.shape != dst.shape or src.dim() != 1:
            raise InputError(f"KVPool.copy needs src and dst of one shape [n], "
                             f"got {tuple(src.shape)} {tuple(dst.shape)}")
        if self.record is None:
            self.storage[dst] = self.storage[src]
        else:
            self._scatter(dst, *self._gather(src))

    def record_bytes(self, slots: torch.Tensor) -> torch.Tensor:
        """slots int64 [n] -> uint8 [n, bytes_per_token]: the stored bytes (data record, then scale record)."""
        if self.record is None:
            return self.storage[slots].view(torch.uint8)
        return torch.cat(self._gather(slots), dim=1)

    def byte_segments(self) -> list:
        """The storage as (base address, page_size, page_bytes, first byte, width in bytes) per
        segment: slot s of a segment lives at base + (s // page_size) * page_bytes + first +
        (s % page_size) * width (an FP8 pool's data and scale records; a plain pool's rows)."""
        base = self.storage.data_ptr()
        if self.record is None:
            row = self.head_dim * self.storage.element_size()
            return [(base, 1, row, 0, row)]
        layout, ps = self.record, self.page_size
        return [(base, ps, self.page_bytes, 0, layout.data_bytes),
                (base, ps, self.page_bytes, ps * layout.data_bytes, layout.scale_bytes)]

    def _byte_index(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat byte offsets of each slot's data record [n, data_bytes] and scale record [n, scale_bytes]."""
        layout, ps = self.record, self.page_size
        page_start = (slots // ps) * self.page_bytes
        offset = slots % ps
        data_start = page_start + offset * layout.data_bytes
        scale_start = page_start + ps * layout.data_bytes + offset * layout.scale_bytes
        data_cols = torch.arange(layout.data_bytes, device=slots.device)
        scale_cols = torch.arange(layout.scale_bytes, device=slots.device)
        return data_start.unsqueeze(1) + data_cols, scale_start.unsqueeze(1) + scale_cols

    def _gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        data_at, scale_at = self._byte_index(slots.to(torch.int64))
        flat = self.storage.view(-1)
        return flat[data_at], flat[scale_at]

    def _scatter(self, slots: torch.Tensor, data: torch.Tensor, scales: torch.Tensor) -> None:
        data_at, scale_at = self._byte_index(slots.to(torch.int64))
        flat = self.storage.view(-1)
        flat[data_at] = data
        flat[scale_at] = scales
