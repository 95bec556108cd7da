"""Synthetic committed caches at any context length (benchmarks): random rows in the same
structures a real prefill fills, without running one."""
from __future__ import annotations

import torch

from .state import CompressorState, RequestCache


def _fill_compressor(st: CompressorState, seq_len: int, g: torch.Generator, dtype, device) -> None:
    n_e, r = divmod(seq_len, st.ratio)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    rows = st.entries
    chunk = 1 << 16
    for start in range(0, n_e, chunk):
        rows.append(rnd(min(chunk, n_e - start), st.head_dim))
    st.buffer_kv, st.buffer_gate = rnd(r, st.channels), rnd(r, st.channels)
    if st.overlap and n_e:
        st.overlap_kv, st.overlap_gate = rnd(st.ratio, st.head_dim), rnd(st.ratio, st.head_dim)


def synthetic_cache(model, seq_len: int, seed: int = 0) -> RequestCache:
    """A RequestCache of `seq_len` committed positions filled with N(0, 1) rows (the scale of
    normed K=V rows and pooled entries)."""
    g = torch.Generator().manual_seed(seed)
    cache = model.new_cache()
    dtype, device = model.dtype, model.device
    w = min(seq_len, model.window)
    for lc in cache.layers:
        lc.window = torch.randn(w, lc.window.shape[1], generator=g).to(device=device, dtype=dtype)
        for st in (lc.main, lc.indexer):
            if st is not None:
                _fill_compressor(st, seq_len, g, dtype, device)
    cache.seq_len = seq_len
    return cache
