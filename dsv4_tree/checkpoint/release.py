"""Write a model in the format DeepSeek releases V4 in, and the tiny release-format checkpoint.

Release format: DeepSeek's tensor names (release_names.py, experts split per expert), linear
weights in FP8 e4m3 with one fp32 scale per 128x128 block (`<module>.weight_scale_inv`),
routed experts FP4-packed with one scale per 32 inputs (`expert_dtype="fp4"`), everything else
(embedding, head, norms, router gates and biases, sinks, position biases, mHC, and the
compressor / indexer projections the release keeps in BF16) in bf16, `quantization_config`
in config.json, the MTP block under `mtp.0.*`, and several shards with
`model.safetensors.index.json`. See quant.py for the formats and their error bounds."""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..errors import CheckpointError
from .files import INDEX_FILE, replaced_directory
from .quant import FP8_BLOCK, FP4_GROUP, fp8_block_shape_ok, quantize_fp4, quantize_fp8_blocks
from .release_names import release_state_dict

SCALE_SUFFIX = "_scale_inv"  # `w.weight` -> `w.weight_scale_inv`
KEEP_DTYPE = torch.bfloat16

# release names of linear weights stored as FP8 (block scales); other linears stay bf16
FP8_LINEAR = re.compile(
    r"(^|\.)(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|attn\.indexer\.wq_b|shared_experts\.w[123]|e_proj|h_proj)\.weight$")
FP4_EXPERT = re.compile(r"\.experts\.\d+\.w[123]\.weight$")


def quantization_config(not_converted: list[str]) -> dict:
    """config.json's quantization_config for what write_release stores."""
    cfg = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
           "scale_fmt": "float", "expert_dtype": "fp4"}
    if not_converted:
        # naming any module turns off transformers' default skips, so the head is named too
        cfg["modules_to_not_convert"] = sorted(set(not_converted) | {"head"})
    return cfg


def storage_kind(name: str, t: torch.Tensor) -> str:
    """'fp4', 'fp8' or 'keep' for a release-named tensor (fp8 only where 128x128 blocks tile it)."""
    if FP4_EXPERT.search(name):
        if t.dim() != 2 or t.shape[1] % FP4_GROUP:
            raise CheckpointError(f"{name}: FP4 experts need an input side divisible by {FP4_GROUP}, got {tuple(t.shape)}")
        return "fp4"
    if FP8_LINEAR.search(name) and fp8_block_shape_ok(t.shape):
        return "fp8"
    return "keep"


def quantize_release(tensors: dict) -> tuple[dict, list[str]]:
    """Release-named dense tensors -> stored tensors, and the FP8-eligible linears kept in bf16."""
    out, not_converted = {}, []
    for name, t in tensors.items():
        kind = storage_kind(name, t)
        if kind == "keep":
            if FP8_LINEAR.search(name) and not name.startswith("mtp."):
                not_converted.append(name[: -len(".weight")])
            out[name] = t.to(KEEP_DTYPE) if t.is_floating_point() else t
            continue
        q, scale = quantize_fp4(t.float()) if kind == "fp4" else quantize_fp8_blocks(t.float())
        out[name] = q
        out[name + SCALE_SUFFIX] = scale
    return out, not_converted


def shard_names(n: int) -> list[str]:
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def _shard_of(name: str, num_layers: int) -> int:
    """Shard 0: embedding and the first half of the layers; 1: the rest and the head; 2: MTP."""
    if name.startswith("mtp."):
        return 2
    m = re.match(r"^layers\.(\d+)\.", name)
    if name.startswith("embed.") or (m and int(m.group(1)) < max(1, num_layers // 2)):
        return 0
    return 1


def write_release(directory, model, mtp=None, dspark=None) -> Path:
    """Save a DeepseekV4ForCausalLM (and its MtpBlock or its DSparkModule, if given: both live
    under `mtp.*`, so at most one) in the release format to `directory` (written to a temporary
    sibling, then renamed into place). A DSpark module adds its `dspark_*` keys to config.json."""
    from .dspark_names import to_checkpoint_names as dspark_names
    from .mtp import to_checkpoint_names

    if mtp is not None and dspark is not None:
        raise CheckpointError("write_release: an MTP block and a DSpark module would both be stored as mtp.*; "
                              "pass one (a DSpark module can also go in a dspark/ subfolder: write_dspark)")
    directory = Path(directory)
    dense = release_state_dict({k: v.detach().cpu() for k, v in model.state_dict().items()})
    if mtp is not None:
        dense.update({k: v.cpu() for k, v in to_checkpoint_names(mtp).items()})
    if dspark is not None:
        dense.update({k: v.cpu() for k, v in dspark_names(dspark).items()})
    stored, not_converted = quantize_release(dense)
    num_layers = model.config.num_hidden_layers
    shards = shard_names(3 if mtp is not None or dspark is not None else 2)
    parts = [dict() for _ in shards]
    for name in sorted(stored):
        parts[_shard_of(name, num_layers)][name] = stored[name].contiguous()
    with replaced_directory(directory) as tmp:
        for fname, part in zip(shards, parts):
            save_file(part, str(tmp / fname), metadata={"format": "pt"})
        total = sum(t.numel() * t.element_size() for t in stored.values())
        weight_map = {n: shards[i] for i, part in enumerate(parts) for n in part}
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2))
        cfg = model.config.to_dict()
        cfg.update(architectures=["DeepseekV4ForCausalLM"], dtype="bfloat16", num_nextn_predict_layers=1 if mtp is not None else 0,
                   quantization_config=quantization_config(not_converted))
        if dspark is not None:
            cfg.update(dspark.settings.to_config(), num_nextn_predict_layers=dspark.settings.num_stages)
        cfg.pop("torch_dtype", None)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    return directory
