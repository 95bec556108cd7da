"""DeepSeek's DSpark block drafter for DeepSeek-V4: its settings and its weights as a module.

DSpark drafts `block_size` (gamma) tokens in one pass of a small backbone:

* **Stages.** One DeepSeek-V4 decoder layer per target layer it reads (`target_layer_ids`):
  mHC, sliding-window MQA with sink and no compressor, routed MoE (the MTP layer's config,
  `draft_weights.draft_layer_config`). Stage 0's input streams are the block's embeddings repeated hc_mult times.
* **Context ("KV injection").** For every committed position p the target's residual streams
  at the *output* of each target layer, averaged over the hc streams and concatenated in
  ascending layer order ([L * hidden]; SGLang's DeepSeek-V4 layer loop, design_notes/dspark.md),
  go through `main_proj` and `main_norm`; each stage's own `kv_proj`, `kv_norm` and RoPE at p
  then give that stage's context K=V row. A request keeps the last `sliding_window` of them.
* **Block.** Rows `[anchor, noise x (gamma - 1)]` at positions P .. P + gamma - 1 (the anchor is
  the pending token at P). Every block row attends to its request's context window and to all
  block rows (not causal inside the block); row k - 1 predicts the token at P + k. With
  `sample_from_anchor` false the block is `[anchor, noise x gamma]` (gamma + 1 rows) and row k
  predicts P + k. After the last stage: `hc_head`, then `norm` and the target's LM head give
  base logits U_k.
* **Markov head.** p_k(v | x_{k-1}) = softmax(U_k + W2 W1[x_{k-1}])_v, x_0 = the anchor,
  applied left to right (W1 = `markov_embed` [V, r], W2 = `markov_head` [V, r]).
* **Confidence head.** c_k = sigmoid(w . [h_k ; W1[x_{k-1}]] / T_k), h_k the hc-collapsed output
  before `norm` (w . h_k alone with `confidence_head_with_markov` false), T_k the per-depth STS
  temperature (1 unless the drafter is given SGLang's STS file): the chance that the depth-k
  draft survives given its parent was accepted.

The checkpoint layout (DeepSeek's release names under `mtp.<s>.`) is in dspark_names.py; the
config keys honoured or refused besides the four core ones in dspark_keys.py."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..errors import CheckpointError
from ..hf_bindings import DeepseekV4Config
from .draft_weights import DSPARK_KEYS, draft_layer_config
from .dspark_keys import check_keys
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
    DeepseekV4DecoderLayer,
    DeepseekV4HyperHead,
    DeepseekV4RMSNorm,
)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class DSparkSettings:
    """The `dspark_*` keys of a checkpoint's config, checked against its target."""

    block_size: int  # gamma: block rows and drafts per round
    markov_rank: int  # r
    noise_token_id: int  # the mask token of block rows 1 .. gamma - 1
    target_layer_ids: tuple  # target layers (ascending) whose output streams feed the context; one stage each
    n_routed_experts: int | None = None  # stage MoE width, when it differs from the target's
    num_experts_per_tok: int | None = None
    sample_from_anchor: bool = True  # False: a gamma + 1 row block, drafts from rows 1..gamma
    confidence_with_markov: bool = True  # False: the confidence head reads h_k alone

    @property
    def block_rows(self) -> int:
        """Rows of one draft block: gamma, or gamma + 1 without sample_from_anchor."""
        return self.block_size + (0 if self.sample_from_anchor else 1)

    @property
    def num_stages(self) -> int:
        return len(self.target_layer_ids)

    @classmethod
    def from_config(cls, cfg: dict, target: DeepseekV4Config, where: str) -> "DSparkSettings":
        """Parse and check the keys of config dict `cfg` (`where` names its file in errors)."""
        missing = [k for k in DSPARK_KEYS if k not in cfg]
        if missing:
            raise CheckpointError(f"{where}: DSpark config key {missing[0]} is missing (a DSpark module needs all of "
                                  f"{', '.join(DSPARK_KEYS)})")
        gamma, rank, noise, layers = (cfg[k] for k in DSPARK_KEYS)
        if not _is_int(gamma) or gamma < 1:
            raise CheckpointError(f"{where}: dspark_block_size must be an int >= 1, got {gamma!r}")
        if not _is_int(rank) or rank < 1:
            raise CheckpointError(f"{where}: dspark_markov_rank must be an int >= 1, got {rank!r}")
        if not _is_int(noise) or not 0 <= noise < target.vocab_size:
            raise CheckpointError(f"{where}: dspark_noise_token_id {noise!r} is outside the vocabulary "
                                  f"[0, {target.vocab_size})")
        if not isinstance(layers, (list, tuple)) or not layers:
            raise CheckpointError(f"{where}: dspark_target_layer_ids must be a non-empty list of layer ids, got {layers!r}")
        for i in layers:
            if not _is_int(i) or not 0 <= i < target.num_hidden_layers:
                raise CheckpointError(f"{where}: dspark_target_layer_ids entry {i!r} is not a target layer "
                                      f"(0 .. {target.num_hidden_layers - 1})")
        if len(set(layers)) != len(layers):
            raise CheckpointError(f"{where}: dspark_target_layer_ids {list(layers)} repeats a layer")
        if list(layers) != sorted(layers):
            raise CheckpointError(f"{where}: dspark_target_layer_ids {list(layers)} is not ascending (SGLang "
                                  "concatenates the layers' features in layer order: list them in that order)")
        extra = check_keys(cfg, where)
        for key, field in (("dspark_n_routed_experts", "n_routed_experts"),
                           ("dspark_num_experts_per_tok", "num_experts_per_tok")):
            if cfg.get(key) is not None:
                if not _is_int(cfg[key]) or cfg[key] < 1:
                    raise CheckpointError(f"{where}: {key} must be an int >= 1, got {cfg[key]!r}")
                extra[field] = cfg[key]
        experts = extra.get("n_routed_experts", target.n_routed_experts)
        top = extra.get("num_experts_per_tok", target.num_experts_per_tok)
        if top > experts:
            key = "dspark_num_experts_per_tok" if "num_experts_per_tok" in extra else "the target's num_experts_per_tok"
            src = "dspark_n_routed_experts" if "n_routed_experts" in extra else "the target's n_routed_experts"
            raise CheckpointError(f"{where}: {key} is {top}, more than the stages' {experts} routed experts ({src}); "
                                  f"it must be <= {experts}")
        return cls(gamma, rank, noise, tuple(layers), **extra)

    def to_config(self) -> dict:
        out = {"dspark_block_size": self.block_size, "dspark_markov_rank": self.markov_rank,
               "dspark_noise_token_id": self.noise_token_id, "dspark_target_layer_ids": list(self.target_layer_ids)}
        if self.n_routed_experts is not None:
            out["dspark_n_routed_experts"] = self.n_routed_experts
        if self.num_experts_per_tok is not None:
            out["dspark_num_experts_per_tok"] = self.num_experts_per_tok
        if not self.sample_from_anchor:
            out["sample_from_anchor"] = False
        if not self.confidence_with_markov:
            out["confidence_head_with_markov"] = False
        return out


def stage_config(config: DeepseekV4Config, settings: DSparkSettings) -> DeepseekV4Config:
    """A stage's layer config: the MTP layer's (sliding window, routed MoE), with the stage
    expert counts when the checkpoint sets them."""
    cfg = draft_layer_config(config)
    if settings.n_routed_experts is not None:
        cfg.n_routed_experts = settings.n_routed_experts
    if settings.num_experts_per_tok is not None:
        cfg.num_experts_per_tok = settings.num_experts_per_tok
    return cfg


class DSparkModule(nn.Module):
    """The DSpark weights (the target's embedding and LM head are shared, not held here)."""

    def __init__(self, config: DeepseekV4Config, settings: DSparkSettings):
        super().__init__()
        cfg = stage_config(config, settings)
        d, eps, v, r = config.hidden_size, config.rms_norm_eps, config.vocab_size, settings.markov_rank
        self.settings = settings
        self.stages = nn.ModuleList(DeepseekV4DecoderLayer(cfg, 0) for _ in range(settings.num_stages))
        self.main_proj = nn.Linear(settings.num_stages * d, d, bias=False)
        self.main_norm = DeepseekV4RMSNorm(d, eps=eps)
        self.hc_head = DeepseekV4HyperHead(cfg)
        self.norm = DeepseekV4RMSNorm(d, eps=eps)
        self.markov_embed = nn.Embedding(v, r)  # W1
        self.markov_head = nn.Linear(r, v, bias=False)  # W2
        self.confidence = nn.Linear(d + (r if settings.confidence_with_markov else 0), 1, bias=False)

    @property
    def block_size(self) -> int:
        return self.settings.block_size

    def markov_bias(self, prev: torch.Tensor) -> torch.Tensor:
        """prev [...] token ids -> W2 W1[prev] [..., vocab]."""
        return self.markov_head(self.markov_embed(prev))

    def confidence_of(self, h: torch.Tensor, prev: torch.Tensor, temperature=None) -> torch.Tensor:
        """h [..., hidden] (hc-collapsed, before norm), prev [...] -> c in (0, 1) [...];
        temperature: the STS temperature(s) dividing the raw logit (None: 1), broadcast to [...]."""
        x = torch.cat([h, self.markov_embed(prev).to(h.dtype)], -1) if self.settings.confidence_with_markov else h
        raw = self.confidence(x).squeeze(-1).float()
        return torch.sigmoid(raw if temperature is None else raw / temperature)
