"""KVPool: one pool of token records (storage only; slots in, rows out)."""
from __future__ import annotations

import torch

from ..errors import ConfigError

KV_DTYPES = ("auto", "bfloat16")


class KVPool:
    def __init__(self, num_slots: int, head_dim: int, rope_dim: int, kv_dtype: str, page_size: int,
                 device, compute_dtype: torch.dtype, kind: str = "kv"):
        if kv_dtype not in KV_DTYPES:
            raise ConfigError(f"kv_cache_dtype={kv_dtype!r} is unknown; choose one of {KV_DTYPES}")
        self.num_slots, self.head_dim, self.rope_dim = num_slots, head_dim, rope_dim
        self.kv_dtype, self.page_size, self.kind = kv_dtype, page_size, kind
        self.compute_dtype = compute_dtype
        self.layout = None
        store = compute_dtype if kv_dtype == "auto" else torch.bfloat16
        self.storage = torch.zeros(num_slots, head_dim, dtype=store, device=device)
        self.bytes_per_token = head_dim * self.storage.element_size()

    def write(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        self.storage.index_copy_(0, slots, rows.to(self.storage.dtype))

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        rows = self.storage[slots.clamp(min=0)].to(self.compute_dtype)
        return rows.masked_fill((slots < 0).unsqueeze(-1), 0)

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.storage.index_copy_(0, dst, self.storage[src])

    def record_bytes(self, slots: torch.Tensor) -> torch.Tensor:
        return self.storage[slots].contiguous().view(torch.uint8).view(slots.shape[0], -1)
