"""Reference draft-extend: the MTP draft layer's cache brought up to its request in a pass of
its own (K=V rows only, one pass for all requests). A draft does this inside its step 0
(drafters/mtp_cache.py: root_step, fold_back); tests compare the two."""
from __future__ import annotations

import torch

from ..attention.layer import kv_rows as layer_kv_rows
from ..drafters.mtp_cache import DraftCache, pending_rows, store_rows
from ..drafters.mtp_rows import layer_input
from ..numerics.hc import hc_collapse
from ..numerics.norms import rms_norm
from ..numerics.rope import apply_rope


@torch.inference_mode()
def ref_draft_kv_rows(model, mtp, ids: torch.Tensor, hidden_in: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The K=V rows the draft layer stores for these inputs ([T, head_dim]): a row's K=V
    depends on its own input alone."""
    h, cos, sin = layer_input(model, mtp, ids, hidden_in, positions)
    layer = mtp.decoder
    return layer_kv_rows(layer.self_attn, rms_norm(layer.input_layernorm, hc_collapse(layer.attn_hc, h)), cos, sin,
                         apply_rope)


def ref_draft_extend(drafter, requests) -> list:
    """Extend `drafter`'s caches of `requests` (an MtpDrafter) in a separate pass; returns them in
    request order (a request new to the drafter starts from an empty cache)."""
    model = drafter.model
    caches = [drafter.caches.get(r.request_id) or DraftCache.empty(model) for r in requests]
    todo = [(c, r) for c, r in zip(caches, requests) if r.seq_len != c.seq_len]
    if todo:
        parts = [pending_rows(model, c, r) for c, r in todo]
        raw = ref_draft_kv_rows(model, drafter.mtp, *(torch.cat([p[i] for p in parts]) for i in range(3)))
        start = 0
        for (cache, req), (ids, _, _, last) in zip(todo, parts):
            store_rows(model, cache, req, raw[start : start + ids.shape[0]], last)
            start += ids.shape[0]
    drafter._keep(requests, caches)
    return caches
