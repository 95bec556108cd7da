"""What the MTP block and the DSpark module share in a checkpoint.

Both drafters are built from the same DeepSeek-V4 decoder layer (compress ratio 0, sliding
window, routed MoE) stored under `mtp.<n>.` in DeepSeek's release names; both loaders import
from here and never from each other:

* `draft_layer_config`: that layer's config, derived from the target's;
* `LAYER_TO_MODULE` / `EXPERT_NAME`: its tensors' checkpoint names (after `mtp.<n>.`) and the
  layer's state-dict names; `stack_experts` / `split_experts` convert the per-expert tensors;
* `DSPARK_KEYS`: the config keys that say a checkpoint's `mtp.*` tensors are a DSpark module,
  not an MTP block (the MTP loader refuses such a checkpoint, the DSpark loader needs them)."""
from __future__ import annotations

import copy
import re

import torch

from ..errors import CheckpointError
from ..hf_bindings import DeepseekV4Config
from .release_names import split_experts as split_stacked

DSPARK_KEYS = ("dspark_block_size", "dspark_markov_rank", "dspark_noise_token_id", "dspark_target_layer_ids")

# checkpoint sub-name (after mtp.<n>.) -> the decoder layer's state-dict name; one table, read both ways
LAYER_TO_MODULE = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    **{f"hc_{part}_{leaf}": f"{part}_hc.{leaf}" for part in ("attn", "ffn") for leaf in ("fn", "base", "scale")},
    "attn.attn_sink": "self_attn.sinks",
    "attn.wq_a.weight": "self_attn.q_a_proj.weight",
    "attn.wq_b.weight": "self_attn.q_b_proj.weight",
    "attn.q_norm.weight": "self_attn.q_a_norm.weight",
    "attn.wkv.weight": "self_attn.kv_proj.weight",
    "attn.norm.weight": "self_attn.kv_norm.weight",
    "attn.wo_a.weight": "self_attn.o_a_proj.weight",
    "attn.wo_b.weight": "self_attn.o_b_proj.weight",
    "ffn.gate.weight": "mlp.gate.weight",
    "ffn.gate.bias": "mlp.gate.e_score_correction_bias",
    "ffn.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "ffn.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
}
EXPERT_NAME = re.compile(r"^ffn\.experts\.(\d+)\.(w1|w2|w3)\.weight$")


def draft_layer_config(config: DeepseekV4Config) -> DeepseekV4Config:
    """The draft layer's config: one sliding-window layer (ratio 0) with a routed MoE."""
    cfg = copy.deepcopy(config)
    cfg.num_hidden_layers = 1
    cfg.layer_types = ["sliding_attention"]
    cfg.mlp_layer_types = ["moe"]
    return cfg


def stack_experts(experts: dict, prefix: str, n: int, into: str) -> dict:
    """Per-expert checkpoint weights {(i, "w1"|"w2"|"w3"): tensor} -> the decoder's stacked
    `{into}mlp.experts.gate_up_proj` / `down_proj`; CheckpointError names the first missing one."""
    missing = [(i, w) for i in range(n) for w in ("w1", "w2", "w3") if (i, w) not in experts]
    if missing:
        raise CheckpointError(f"experts incomplete: missing {prefix}ffn.experts.{missing[0][0]}.{missing[0][1]}.weight")
    return {f"{into}mlp.experts.gate_up_proj": torch.stack(
                [torch.cat([experts[(i, "w1")], experts[(i, "w3")]], 0) for i in range(n)]),
            f"{into}mlp.experts.down_proj": torch.stack([experts[(i, "w2")] for i in range(n)])}


def split_experts(sd: dict, into: str, prefix: str) -> dict:
    """Inverse of stack_experts: the decoder's stacked experts under `into` -> checkpoint names under
    `prefix` (release_names.split_experts, the main layers' own split)."""
    return split_stacked(f"{prefix}ffn.", sd[f"{into}mlp.experts.gate_up_proj"], sd[f"{into}mlp.experts.down_proj"])
