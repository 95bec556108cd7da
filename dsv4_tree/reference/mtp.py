"""Reference runs of the MTP block: the Hugging Face decoder layer's own (dense, masked)
forward over a set of MTP rows, no cache."""
from __future__ import annotations

import torch


@torch.no_grad()
def mtp_masked_rows(model, mtp, tokens: torch.Tensor, hidden_in: torch.Tensor, positions: torch.Tensor,
                    visible: torch.Tensor):
    """Rows with tokens [L], input streams hidden_in [L, hc, hidden] at RoPE positions [L];
    row i attends to the rows j with visible[i, j] ([L, L] bool). Returns (logits [L, vocab],
    out streams [L, hc, hidden])."""
    hf = model.hf.model
    ids = torch.as_tensor(tokens, dtype=torch.int64).to(model.device).unsqueeze(0)
    emb = hf.embed_tokens(ids)
    x = mtp.inputs(emb[0], hidden_in.to(model.device))
    pos = positions.to(model.device).unsqueeze(0)
    pe = {label: hf.rotary_emb(emb, position_ids=pos, layer_type=label) for label in ("main", "compress")}
    n = ids.shape[1]
    mask = torch.zeros(1, 1, n, n, dtype=x.dtype, device=model.device)
    mask = mask.masked_fill(~visible.to(model.device), float("-inf"))
    h = mtp.decoder(x, input_ids=ids, position_embeddings=pe, position_ids=pos, attention_mask=mask)
    logits = model.hf.lm_head(mtp.norm(mtp.hc_head(h)))[0]
    return logits, h[0]


def mtp_reference_rows(model, mtp, tokens: torch.Tensor, hidden_in: torch.Tensor):
    """Row q: input token tokens[q] with streams hidden_in[q] ([L, hc, hidden]) at position q,
    causal sliding window over rows 0..q. Returns (logits [L, vocab], out streams [L, hc, hidden])."""
    n = len(tokens)
    i = torch.arange(n)
    ok = (i.view(-1, 1) >= i.view(1, -1)) & (i.view(-1, 1) - i.view(1, -1) < model.window)
    return mtp_masked_rows(model, mtp, tokens, hidden_in, i, ok)
