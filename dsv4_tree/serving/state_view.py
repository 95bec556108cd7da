"""A request's committed state read back from the pools in Hugging Face's cache-field names
(for equality checks against serial decoding and HF's own cache; not on the verify path)."""
from __future__ import annotations

import torch

from .pages import PageTable
from .pools import Layout


@torch.no_grad()
def committed_view(pools: list, pages: PageTable, layout: Layout, row: int, seq_len: int, gate_bias: list) -> list:
    """Per layer, dict name -> tensor (host copies):
    window [min(P, W), d]; <c>.entries [n_e, d]; <c>.buffer_kv / buffer_gate [P - n_e*m, ch]
    (gate without bias); <c>.overlap_kv / overlap_gate [m, d] (C4, once a block closed; gate
    with bias); <c>.entry_count; for c in main, indexer. gate_bias: per layer, compressor name
    -> its position bias [m, ch] (what the overlap gate adds; the model side supplies it)."""
    def recent(first: int, last: int) -> torch.Tensor:
        pos = torch.arange(first, last)
        return pages.recent_slots(pages.token_slots(torch.full_like(pos, row), pos)).to(lp.swa.storage.device)

    out = []
    for lp, biases in zip(pools, gate_bias):
        view = {"window": lp.swa.read(recent(max(0, seq_len - layout.window), seq_len)).cpu()}
        for name, cp in (("main", lp.main), ("indexer", lp.indexer)):
            if cp is None:
                continue
            m, n_e = cp.ratio, seq_len // cp.ratio
            k = torch.arange(n_e)
            slots = layout.entry_slot(m, pages.token_slots(torch.full_like(k, row), k * m)).to(cp.rows_kv.device)
            view[f"{name}.entries"] = cp.entries.read(slots).cpu()
            buf = recent(n_e * m, seq_len)
            view[f"{name}.buffer_kv"] = cp.rows_kv[buf].cpu()
            view[f"{name}.buffer_gate"] = cp.rows_gate[buf].cpu()
            view[f"{name}.entry_count"] = torch.tensor(n_e)
            if cp.overlap and n_e:
                last = recent((n_e - 1) * m, n_e * m)
                d = cp.head_dim
                view[f"{name}.overlap_kv"] = cp.rows_kv[last][:, :d].cpu()
                view[f"{name}.overlap_gate"] = (cp.rows_gate[last] + biases[name])[:, :d].cpu()
        out.append(view)
    return out
