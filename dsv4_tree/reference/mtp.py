"""Reference run of the MTP block: the Hugging Face decoder layer's own (dense, masked)
forward over a whole sequence of MTP rows, no cache."""
from __future__ import annotations

import torch


@torch.no_grad()
def mtp_reference_rows(model, mtp, tokens: torch.Tensor, hidden_in: torch.Tensor):
    """Row q: input token tokens[q] with streams hidden_in[q] ([L, hc, hidden]) at position q,
    causal sliding window over rows 0..q. Returns (logits [L, vocab], out streams [L, hc, hidden])."""
    hf = model.hf.model
    ids = torch.as_tensor(tokens, dtype=torch.int64).to(model.device).unsqueeze(0)
    L = ids.shape[1]
    emb = hf.embed_tokens(ids)
    x = mtp.inputs(emb[0], hidden_in)
    pos = torch.arange(L, device=model.device).unsqueeze(0)
    pe = {label: hf.rotary_emb(emb, position_ids=pos, layer_type=label) for label in ("main", "compress")}
    i = torch.arange(L, device=model.device)
    ok = (i.view(-1, 1) >= i.view(1, -1)) & (i.view(-1, 1) - i.view(1, -1) < model.window)
    mask = torch.zeros(1, 1, L, L, dtype=x.dtype, device=model.device).masked_fill(~ok, float("-inf"))
    h = mtp.decoder(x, input_ids=ids, position_embeddings=pe, position_ids=pos, attention_mask=mask)
    logits = model.hf.lm_head(mtp.norm(mtp.hc_head(h)))[0]
    return logits, h[0]
