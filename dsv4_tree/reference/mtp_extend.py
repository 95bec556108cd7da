"""Reference draft-extend: SGLang's rule for the MTP rows of committed positions, row by row,
and the draft-layer window they give, through the Hugging Face decoder layer's own forward.

SGLang 0.5.23's draft-extend after a target pass over positions 0 .. P-1 (its EAGLE worker's
draft-extend for DeepSeek-V4's NextN) makes one row per committed position t: the token
x_{t+1} (for t = P-1, the pending token) with the target's residual streams at t (before
hc_head), at RoPE position t. No row pairs x_0 with anything. The drafter places the same row
at position t + 1 (RoPE is relative) and keeps the K=V rows of t = 0 .. P-2 as its window; the
row of t = P-1 is its draft's root row (design_notes/mtp-drafter.md).

Independent of the drafter (drafters/mtp_cache.py, mtp_rows.py): tokens and streams in, rows
and K=V out, nothing below the Hugging Face modules shared."""
from __future__ import annotations

import torch


class _KvRecorder:
    """The cache a DeepseekV4Attention call sees: it records the K=V rows the call computes."""

    def __init__(self):
        self.kv = None

    def update(self, key, value, layer_idx):
        self.kv = key
        return key, value


def sglang_extend_rows(tokens: torch.Tensor, root: int, streams: torch.Tensor):
    """SGLang's draft-extend rows, one per committed position t = 0 .. P-1, built one at a time.

    tokens [P] committed ids x_0 .. x_{P-1}; root: the pending token x_P; streams [P, hc, hidden]
    the target's streams at 0 .. P-1. -> (ids [P], input streams [P, hc, hidden], positions [P])."""
    tokens = torch.as_tensor(tokens, dtype=torch.int64).cpu()
    ids, hid, pos = [], [], []
    for t in range(tokens.numel()):
        ids.append(int(tokens[t + 1]) if t + 1 < tokens.numel() else int(root))
        hid.append(streams[t])
        pos.append(t)
    if not ids:
        return torch.zeros(0, dtype=torch.int64), streams[:0], torch.zeros(0, dtype=torch.int64)
    return torch.tensor(ids), torch.stack(hid), torch.tensor(pos)


@torch.no_grad()
def ref_draft_window(model, mtp, tokens: torch.Tensor, root: int, streams: torch.Tensor):
    """The draft layer's window after SGLang's draft-extend over P >= 1 committed positions.

    -> (K=V rows [min(W, P - 1), head_dim] of the rows t = P-1-w .. P-2, each after kv_norm and
    RoPE at the drafter's position t + 1, as `DeepseekV4Attention` computes them; the streams at
    P - 1, the next root row's input). W = the sliding window."""
    ids, hid, pos = sglang_extend_rows(tokens, root, streams)
    if ids.numel() == 0:
        raise ValueError("ref_draft_window: no committed position (P = 0): SGLang drafts after a target pass")
    hf, dev = model.hf.model, model.device
    x_ids = ids[:-1].to(dev).unsqueeze(0)  # the root row (t = P - 1) is the draft's, not the window's
    kept = streams[-1].clone()
    if x_ids.shape[1] == 0:
        return torch.zeros(0, model.config.head_dim, dtype=model.dtype, device=dev), kept
    emb = hf.embed_tokens(x_ids)
    x = mtp.inputs(emb[0], hid[:-1].to(dev))  # [1, n, hc, hidden]
    p = (pos[:-1] + 1).to(dev).unsqueeze(0)  # the drafter's placement: SGLang's row t at t + 1
    pe = {label: hf.rotary_emb(emb, position_ids=p, layer_type=label) for label in ("main", "compress")}
    n = x_ids.shape[1]
    mask = torch.zeros(1, 1, n, n, dtype=x.dtype, device=dev)
    mask = mask.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=dev).tril(), float("-inf"))
    rec = _KvRecorder()
    mtp.decoder(x, input_ids=x_ids, position_embeddings=pe, position_ids=p, attention_mask=mask, past_key_values=rec)
    return rec.kv[0, 0][-model.window:], kept
