"""DeepSeek's own tensor names (the released checkpoint's) for a DeepseekV4ForCausalLM state dict.

This is the inverse of transformers' `deepseek_v4` conversion mapping (which renames release
keys to module names on load): one literal table per scope, read in one direction here; the
tests load the result back through transformers and compare every weight, so the table cannot
drift from the mapping unnoticed. Routed experts are split per expert (`w1` gate, `w3` up,
`w2` down), as the release stores them."""
from __future__ import annotations

import re

import torch

from ..errors import CheckpointError

# module name inside `model.layers.N.` -> release name inside `layers.N.`
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    **{f"{part}_hc.{leaf}": f"hc_{part}_{leaf}" for part in ("attn", "ffn") for leaf in ("fn", "base", "scale")},
    "self_attn.sinks": "attn.attn_sink",
    "self_attn.q_a_proj.weight": "attn.wq_a.weight",
    "self_attn.q_a_norm.weight": "attn.q_norm.weight",
    "self_attn.q_b_proj.weight": "attn.wq_b.weight",
    "self_attn.kv_proj.weight": "attn.wkv.weight",
    "self_attn.kv_norm.weight": "attn.norm.weight",
    "self_attn.o_a_proj.weight": "attn.wo_a.weight",
    "self_attn.o_b_proj.weight": "attn.wo_b.weight",
    "self_attn.compressor.kv_proj.weight": "attn.compressor.wkv.weight",
    "self_attn.compressor.gate_proj.weight": "attn.compressor.wgate.weight",
    "self_attn.compressor.position_bias": "attn.compressor.ape",
    "self_attn.compressor.kv_norm.weight": "attn.compressor.norm.weight",
    "self_attn.compressor.indexer.kv_proj.weight": "attn.indexer.compressor.wkv.weight",
    "self_attn.compressor.indexer.gate_proj.weight": "attn.indexer.compressor.wgate.weight",
    "self_attn.compressor.indexer.position_bias": "attn.indexer.compressor.ape",
    "self_attn.compressor.indexer.kv_norm.weight": "attn.indexer.compressor.norm.weight",
    "self_attn.compressor.indexer.q_b_proj.weight": "attn.indexer.wq_b.weight",
    "self_attn.compressor.indexer.scorer.weights_proj.weight": "attn.indexer.weights_proj.weight",
    "mlp.gate.weight": "ffn.gate.weight",
    "mlp.gate.e_score_correction_bias": "ffn.gate.bias",
    "mlp.gate.tid2eid": "ffn.gate.tid2eid",
    "mlp.shared_experts.gate_proj.weight": "ffn.shared_experts.w1.weight",
    "mlp.shared_experts.down_proj.weight": "ffn.shared_experts.w2.weight",
    "mlp.shared_experts.up_proj.weight": "ffn.shared_experts.w3.weight",
}

# top-level module name -> release name
TOP_NAMES = {
    "model.embed_tokens.weight": "embed.weight",
    "lm_head.weight": "head.weight",
    "model.norm.weight": "norm.weight",
    **{f"model.hc_head.hc_{leaf}": f"hc_head_{leaf}" for leaf in ("fn", "base", "scale")},
}

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERTS = {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"}


def split_experts(prefix: str, gate_up: torch.Tensor, down: torch.Tensor) -> dict:
    """Stacked experts gate_up [E, 2I, H] and down [E, H, I] -> per-expert w1 / w3 / w2 weights."""
    half = gate_up.shape[1] // 2
    out = {}
    for e in range(gate_up.shape[0]):
        out[f"{prefix}experts.{e}.w1.weight"] = gate_up[e, :half].contiguous()
        out[f"{prefix}experts.{e}.w3.weight"] = gate_up[e, half:].contiguous()
        out[f"{prefix}experts.{e}.w2.weight"] = down[e].contiguous()
    return out


def release_state_dict(state: dict) -> dict:
    """A DeepseekV4ForCausalLM state dict -> the same tensors under release names (experts split).
    Rotary inv_freq buffers are derived from the config and are not stored."""
    out = {}
    for name, t in state.items():
        if name.endswith("inv_freq"):
            continue
        m = _LAYER.match(name)
        if name in TOP_NAMES:
            out[TOP_NAMES[name]] = t
        elif m and m.group(2) in LAYER_NAMES:
            out[f"layers.{m.group(1)}.{LAYER_NAMES[m.group(2)]}"] = t
        elif m and m.group(2) in _EXPERTS:
            if m.group(2) == "mlp.experts.gate_up_proj":
                prefix = f"layers.{m.group(1)}.ffn."
                out.update(split_experts(prefix, t, state[f"model.layers.{m.group(1)}.mlp.experts.down_proj"]))
        else:
            raise CheckpointError(f"no release name for the model tensor {name!r}")
    return out
