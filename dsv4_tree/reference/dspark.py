"""Reference DSpark forward, one request at a time, through the Hugging Face modules' own code.

* `ref_target_features`: the target's full forward over the committed tokens with a hook on
  each target layer's output: its residual streams averaged over the hc streams, concatenated
  in ascending layer order (SGLang's DeepSeek-V4 layer loop).
* `ref_dspark_block`: the context K=V of the last `sliding_window` committed positions from
  those features (main_proj, main_norm, each stage's kv_proj / kv_norm / RoPE), then each
  stage as transformers' `DeepseekV4DecoderLayer.forward` over the block rows, its attention
  reading the injected context through a one-call cache and a mask that lets every block row
  see the whole context window and the whole block; hc_head, norm, the target's LM head
  (the block is gamma + 1 rows, the anchor's predicting nothing, without sample_from_anchor).
* `ref_dspark_chain`: the Markov-biased distributions and confidences along given tokens.

Independent of the drafter's batched path (drafters/dspark_rows.py): no shared helper below
the Hugging Face modules."""
from __future__ import annotations

import torch

from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb


class _InjectedContext:
    """The cache a DeepseekV4Attention call sees: its K=V rows go after the context rows."""

    def __init__(self, context: torch.Tensor):
        self.context = context  # [1, 1, M, head_dim]

    def update(self, key, value, layer_idx):
        kv = torch.cat([self.context.to(key.dtype), key], dim=2)
        return kv, kv


@torch.no_grad()
def ref_target_features(model, tokens, layer_ids) -> torch.Tensor:
    """tokens [P] committed ids -> [P, len(layer_ids) * hidden]: per position, the mean over the hc
    streams of the residual streams leaving each target layer, layers in ascending order."""
    seen = {}
    hooks = [model.hf.model.layers[i].register_forward_hook(
        lambda mod, args, out, i=i: seen.__setitem__(i, out.mean(2))) for i in layer_ids]
    try:
        ids = torch.as_tensor(tokens, dtype=torch.int64).to(model.device).unsqueeze(0)
        model.hf(input_ids=ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return torch.cat([seen[i][0] for i in sorted(layer_ids)], -1)


@torch.no_grad()
def ref_dspark_block(model, module, features: torch.Tensor, anchor: int) -> tuple[torch.Tensor, torch.Tensor]:
    """features [P, L * hidden] of committed positions 0 .. P-1; anchor: the token at P.
    -> (base logits U [gamma, vocab], hc-collapsed block outputs before norm [gamma, hidden])."""
    hf, cfg, settings = model.hf.model, model.config, module.settings
    gamma, p = settings.block_size + (0 if settings.sample_from_anchor else 1), features.shape[0]
    lo = max(0, p - cfg.sliding_window)
    ctx_pos = torch.arange(lo, p, device=model.device).unsqueeze(0)
    main_x = module.main_norm(module.main_proj(features[lo:p].to(model.device))).unsqueeze(0)  # [1, M, d]
    cos, sin = hf.rotary_emb(main_x, position_ids=ctx_pos, layer_type="main")
    ids = torch.tensor([[anchor] + [settings.noise_token_id] * (gamma - 1)], device=model.device)
    pos = torch.arange(p, p + gamma, device=model.device).unsqueeze(0)
    emb = hf.embed_tokens(ids)
    h = emb.unsqueeze(2).expand(-1, -1, cfg.hc_mult, -1).contiguous()
    pe = {label: hf.rotary_emb(emb, position_ids=pos, layer_type=label) for label in ("main", "compress")}
    mask = torch.zeros(1, 1, gamma, p - lo + gamma, dtype=h.dtype, device=model.device)  # all visible
    for stage in module.stages:
        attn = stage.self_attn
        ctx = attn.kv_norm(attn.kv_proj(main_x)).view(1, p - lo, 1, -1).transpose(1, 2)  # [1, 1, M, head_dim]
        ctx = apply_rotary_pos_emb(ctx, cos, sin)
        h = stage(h, input_ids=ids, position_embeddings=pe, position_ids=pos, attention_mask=mask,
                  past_key_values=_InjectedContext(ctx))
    collapsed = module.hc_head(h)[0, gamma - settings.block_size:]  # the rows that predict
    return model.hf.lm_head(module.norm(collapsed)), collapsed


@torch.no_grad()
def ref_dspark_chain(module, base: torch.Tensor, hidden: torch.Tensor, prev: torch.Tensor, temperatures=None):
    """base [gamma, vocab], hidden [gamma, hidden], prev [gamma] the token before each position
    (the anchor, then the drafts); temperatures: STS temperature per position (None: 1).
    -> (Markov-biased logits [gamma, vocab] fp32, confidences [gamma])."""
    w1, w2, w = module.markov_embed.weight, module.markov_head.weight, module.confidence.weight[0]
    with_markov = module.settings.confidence_with_markov
    logits, conf = [], []
    for k in range(base.shape[0]):
        e = w1[int(prev[k])]
        logits.append(base[k].float() + (w2 @ e).float())
        raw = ((torch.cat([hidden[k], e.to(hidden.dtype)]) if with_markov else hidden[k]) @ w).float()
        conf.append(torch.sigmoid(raw if temperatures is None else raw / float(temperatures[k])))
    return torch.stack(logits), torch.stack(conf)
