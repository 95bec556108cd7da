"""Synthetic committed requests at any context length (benchmarks): random rows written into
the same pools and slots a real prefill fills, without running one."""
from __future__ import annotations

import torch


@torch.no_grad()
def synthetic_request(engine, seq_len: int, seed: int = 0, root_token: int = 5):
    """A Request with `seq_len` committed positions whose stored rows, compressor rows and
    entries are N(0, 1) (the scale of normed K=V rows and pooled entries)."""
    rt, model = engine.runtime, engine.model
    g = torch.Generator().manual_seed(seed)
    row = rt.admit()
    try:  # the pages first: adopt takes committed positions only with pages behind them
        rt.pages.ensure([row], [seq_len], [seq_len - rt.layout.recent_window])
        req = engine.adopt(torch.randint(2, model.vocab_size, (seq_len,), generator=g), root_token, row, seq_len)
    except BaseException:
        rt.release_row(row)
        raise
    pos = torch.arange(max(0, seq_len - rt.layout.recent_window), seq_len)
    rows = torch.full_like(pos, row)
    recent = rt.pages.recent_slots(rt.pages.token_slots(rows, pos)).to(model.device)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device=model.device, dtype=model.dtype)

    for lp in rt.pools:
        lp.swa.write(recent, rnd(recent.shape[0], lp.swa.head_dim))
        for comp in lp.compressors:
            comp.write_rows(recent, rnd(recent.shape[0], comp.rows_kv.shape[1]), rnd(recent.shape[0], comp.rows_kv.shape[1]))
            n_e = seq_len // comp.ratio
            for start in range(0, n_e, 1 << 15):
                k = torch.arange(start, min(n_e, start + (1 << 15)))
                first = rt.pages.token_slots(torch.full_like(k, row), k * comp.ratio)
                slots = rt.layout.entry_slot(comp.ratio, first).to(model.device)
                comp.entries.write(slots, rnd(k.numel(), comp.head_dim))
    return req


def committed_bytes(engine, seq_len: int) -> int:
    """Bytes the pools hold for one request's committed state of `seq_len` positions."""
    rt = engine.runtime
    total = 0
    for lp in rt.pools:
        total += min(seq_len, rt.layout.window) * lp.swa.bytes_per_token
        for comp in lp.compressors:
            total += (seq_len // comp.ratio) * comp.entries.bytes_per_token
    return total
