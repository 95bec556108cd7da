"""The DeepSeek-V4 MTP block (next-token predictor used as the draft model).

One decoder layer with compress ratio 0 (sliding window only) and its own routed MoE, plus
enorm / hnorm / e_proj / h_proj and its own hyper-connection head; it shares the main
model's embedding and LM head. Input of the row at position p: e_proj(enorm(embed(x_p)))
broadcast over the hc_mult streams plus h_proj(hnorm(h)), where h is the main model's
residual streams (before hc_head) at position p-1 (p >= 1: no row pairs x_0 with anything, as in
SGLang's draft-extend) or, for deeper draft
rows, the MTP's own output streams of the parent row.

Transformers drops `mtp.*` tensors on load; we read them from the checkpoint's safetensors
in DeepSeek's naming (`mtp.0.<layer tensors as in layers.N>`, `mtp.0.enorm.weight`, ...),
dequantising FP8 / FP4 ones on the CPU (release format, see checkpoint_files.py)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ..errors import CheckpointError
from .files import read_config, read_tensors
from .draft_weights import DSPARK_KEYS, EXPERT_NAME, LAYER_TO_MODULE, draft_layer_config, split_experts, stack_experts
from ..hf_bindings import DeepseekV4Config
from ..numerics.norms import rms_norm
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
    DeepseekV4DecoderLayer,
    DeepseekV4HyperHead,
    DeepseekV4RMSNorm,
)

MTP_PREFIX = "mtp.0."

# checkpoint name (after mtp.0.) -> MtpBlock state-dict name; one table, read both ways
CKPT_TO_MODULE = {
    **{k: f"decoder.{v}" for k, v in LAYER_TO_MODULE.items()},
    **{f"hc_head_{leaf}": f"hc_head.hc_{leaf}" for leaf in ("fn", "base", "scale")},
    **{f"{m}.weight": f"{m}.weight" for m in ("enorm", "hnorm", "e_proj", "h_proj", "norm")},
}
MODULE_TO_CKPT = {v: k for k, v in CKPT_TO_MODULE.items()}


class MtpBlock(nn.Module):
    def __init__(self, config: DeepseekV4Config):
        super().__init__()
        cfg = draft_layer_config(config)
        d, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = DeepseekV4RMSNorm(d, eps=eps)
        self.hnorm = DeepseekV4RMSNorm(d, eps=eps)
        self.e_proj = nn.Linear(d, d, bias=False)
        self.h_proj = nn.Linear(d, d, bias=False)
        self.decoder = DeepseekV4DecoderLayer(cfg, 0)
        self.hc_head = DeepseekV4HyperHead(cfg)
        self.norm = DeepseekV4RMSNorm(d, eps=eps)

    def inputs(self, embed: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """embed [T, d] (token embeddings), hidden [T, hc, d] -> layer input [1, T, hc, d]."""
        e = self.e_proj(rms_norm(self.enorm, embed))
        return (e.unsqueeze(1) + self.h_proj(rms_norm(self.hnorm, hidden))).unsqueeze(0)


def mtp_state_dict(tensors: dict, config: DeepseekV4Config) -> dict:
    """Checkpoint tensors named mtp.0.* -> MtpBlock state dict (experts stacked)."""
    out, experts = {}, {}
    for name, t in tensors.items():
        sub = name[len(MTP_PREFIX) :]
        m = EXPERT_NAME.match(sub)
        if m:
            experts[(int(m.group(1)), m.group(2))] = t
            continue
        target = CKPT_TO_MODULE.get(sub)
        if target is None:
            raise CheckpointError(f"unrecognised MTP tensor {name!r}")
        out[target] = t
    out.update(stack_experts(experts, MTP_PREFIX, config.n_routed_experts, "decoder."))
    return out


def to_checkpoint_names(block: MtpBlock) -> dict:
    """Inverse of mtp_state_dict: MtpBlock weights in DeepSeek's checkpoint naming."""
    sd = {k: v.detach().clone().contiguous() for k, v in block.state_dict().items()}
    out = {MTP_PREFIX + MODULE_TO_CKPT[k]: v for k, v in sd.items() if k in MODULE_TO_CKPT}
    out.update(split_experts(sd, "decoder.", MTP_PREFIX))
    unused = set(sd) - set(MODULE_TO_CKPT) - {"decoder.mlp.experts.gate_up_proj", "decoder.mlp.experts.down_proj"}
    unused = {k for k in unused if not k.endswith(("inv_freq", "original_inv_freq"))}
    if unused:
        raise CheckpointError(f"MTP weights without a checkpoint name: {sorted(unused)}")
    return out


def read_mtp_tensors(directory: Path) -> dict:
    """The mtp.* tensors of every shard (the index's, when there is one), FP8 / FP4 dequantised."""
    return read_tensors(Path(directory), MTP_PREFIX)


def load_mtp(model) -> MtpBlock:
    """The MTP block of a loaded model's checkpoint (reads its safetensors again)."""
    if model.source is None:
        raise CheckpointError("the model was not loaded from a checkpoint directory, so its mtp.* weights are unknown")

    if any(k in read_config(model.source) for k in DSPARK_KEYS):
        raise CheckpointError(f"{model.source}: its mtp.* tensors are a DSpark module (config.json has dspark_* keys), "
                              "not an MTP block: draft with drafter='dspark'")
    tensors = read_mtp_tensors(model.source)
    if not tensors:
        raise CheckpointError(
            f"{model.source} has no MTP weights: no tensor named {MTP_PREFIX}* in its *.safetensors "
            f"(config num_nextn_predict_layers={getattr(model.config, 'num_nextn_predict_layers', None)})"
        )
    block = MtpBlock(model.config)
    sd = mtp_state_dict(tensors, model.config)
    own = block.state_dict()
    missing = sorted(k for k in own if k not in sd and not k.endswith("inv_freq"))
    if missing:
        raise CheckpointError(f"{model.source}: MTP weights missing for {missing[:3]} (and {max(0, len(missing) - 3)} more)")
    for k, v in sd.items():
        if own[k].shape != v.shape:
            raise CheckpointError(f"MTP tensor for {k}: shape {tuple(v.shape)}, expected {tuple(own[k].shape)}")
    block.load_state_dict(sd, strict=False)
    return block.to(device=model.device, dtype=model.dtype).eval()


def add_mtp_to_checkpoint(directory: Path, block: MtpBlock) -> None:
    """Append the block's tensors (DeepSeek naming) to directory/model.safetensors."""
    path = Path(directory) / "model.safetensors"
    tensors = load_file(str(path))
    tensors.update(to_checkpoint_names(block))
    save_file(tensors, str(path), metadata={"format": "pt"})
    cfg_path = Path(directory) / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["num_nextn_predict_layers"] = 1
    cfg_path.write_text(json.dumps(cfg, indent=2))
