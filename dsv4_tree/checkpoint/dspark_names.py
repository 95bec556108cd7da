"""DSpark in DeepSeek's release layout: tensor names, finding the module, loading, writing.

Names (release naming of a decoder layer, as under `layers.N.`, per stage s):

* `mtp.<s>.{attn_norm, ffn_norm, hc_attn_*, hc_ffn_*, attn.*, ffn.*}`: stage s's layer;
* `mtp.0.main_proj.weight`, `mtp.0.main_norm.weight`: the context projection (stage 0 only);
* `mtp.<S-1>.{norm.weight, hc_head_fn, hc_head_base, hc_head_scale}`: the head side;
* `mtp.<S-1>.markov_head.embed.weight` (W1 [V, r]), `mtp.<S-1>.markov_head.head.weight` (W2 [V, r]);
* `mtp.<S-1>.confidence_head.proj.weight` ([1, hidden + r]).

Where: bundled in the target's own files (its config.json holds the `dspark_*` keys), or a
`dspark/` subfolder with a config.json of its own (as SGLang finds them). The `mtp.*` names are
also the MTP / NextN block's: only the `dspark_*` keys make `mtp.*` a DSpark module."""
from __future__ import annotations

import json
import os
from pathlib import Path

from safetensors.torch import save_file

from ..errors import CheckpointError
from .draft_weights import DSPARK_KEYS, EXPERT_NAME, LAYER_TO_MODULE, split_experts, stack_experts
from .dspark import DSparkModule, DSparkSettings
from .files import read_config, read_tensors, replaced_directory

SUBFOLDER = "dspark"
# config keys that shape the stages (built from the target's config): a DSpark config.json holding
# one must agree with the target (stage expert counts have their own dspark_* keys)
STRUCTURE_KEYS = ("hidden_size", "vocab_size", "head_dim", "num_attention_heads", "q_lora_rank", "o_lora_rank",
                  "o_groups", "hc_mult", "hc_sinkhorn_iters", "sliding_window", "moe_intermediate_size",
                  "n_shared_experts", "rms_norm_eps", "rope_theta", "rope_parameters")
PREFIX = "mtp."
_FIRST = {"main_proj.weight": "main_proj.weight", "main_norm.weight": "main_norm.weight"}
_LAST = {"norm.weight": "norm.weight", **{f"hc_head_{x}": f"hc_head.hc_{x}" for x in ("fn", "base", "scale")},
         "markov_head.embed.weight": "markov_embed.weight", "markov_head.head.weight": "markov_head.weight",
         "confidence_head.proj.weight": "confidence.weight"}


def _module_name(stage: int, sub: str, num_stages: int) -> str | None:
    if sub in LAYER_TO_MODULE:
        return f"stages.{stage}.{LAYER_TO_MODULE[sub]}"
    if stage == 0 and sub in _FIRST:
        return _FIRST[sub]
    if stage == num_stages - 1 and sub in _LAST:
        return _LAST[sub]
    return None


def to_checkpoint_names(module: DSparkModule) -> dict:
    """The module's weights in DeepSeek's release naming (dense, detached copies)."""
    sd = {k: v.detach().clone().contiguous() for k, v in module.state_dict().items()}
    s_last = module.settings.num_stages - 1
    back = {}
    for s in range(module.settings.num_stages):
        back.update({f"stages.{s}.{v}": f"{PREFIX}{s}.{k}" for k, v in LAYER_TO_MODULE.items()})
    back.update({v: f"{PREFIX}0.{k}" for k, v in _FIRST.items()})
    back.update({v: f"{PREFIX}{s_last}.{k}" for k, v in _LAST.items()})
    out = {back[k]: v for k, v in sd.items() if k in back}
    for s in range(module.settings.num_stages):
        out.update(split_experts(sd, f"stages.{s}.", f"{PREFIX}{s}."))
    stacked = {f"stages.{s}.mlp.experts.{w}" for s in range(module.settings.num_stages) for w in ("gate_up_proj", "down_proj")}
    unused = {k for k in set(sd) - set(back) - stacked if not k.endswith(("inv_freq", "original_inv_freq"))}
    if unused:
        raise CheckpointError(f"DSpark weights without a checkpoint name: {sorted(unused)}")
    return out


def module_state_dict(tensors: dict, settings: DSparkSettings, num_experts: int, where: str) -> dict:
    """Release-named `mtp.*` tensors -> DSparkModule state dict; CheckpointError names a stray tensor."""
    out, experts = {}, [dict() for _ in range(settings.num_stages)]
    for name, t in tensors.items():
        head, _, sub = name[len(PREFIX):].partition(".")
        stage = int(head) if head.isdigit() else -1
        if not 0 <= stage < settings.num_stages:
            raise CheckpointError(f"{where}: tensor {name!r} belongs to no DSpark stage "
                                  f"({settings.num_stages} stages, one per dspark_target_layer_ids entry)")
        m = EXPERT_NAME.match(sub)
        if m:
            experts[stage][(int(m.group(1)), m.group(2))] = t
            continue
        target = _module_name(stage, sub, settings.num_stages)
        if target is None:
            raise CheckpointError(f"{where}: unrecognised DSpark tensor {name!r}")
        out[target] = t
    for s, ex in enumerate(experts):
        out.update(stack_experts(ex, f"{PREFIX}{s}.", num_experts, f"stages.{s}."))
    return out


def find_dspark(directory) -> tuple[Path, dict, str] | None:
    """(folder holding the module's tensors, its config dict, the config file's name) or None."""
    directory = Path(directory)
    sub = directory / SUBFOLDER
    if (sub / "config.json").is_file():
        return sub, read_config(sub), str(sub / "config.json")
    if (directory / "config.json").is_file():
        cfg = read_config(directory)
        if any(k in cfg for k in DSPARK_KEYS):
            return directory, cfg, str(directory / "config.json")
    return None


def has_dspark(directory) -> bool:
    return directory is not None and find_dspark(directory) is not None


def load_dspark(model) -> DSparkModule:
    """The DSpark module of a loaded model's checkpoint, on the model's device and dtype."""
    if model.source is None:
        raise CheckpointError("the model was not loaded from a checkpoint directory, so its DSpark weights are unknown")
    found = find_dspark(model.source)
    if found is None:
        raise CheckpointError(f"{model.source} has no DSpark module: no dspark_* keys in its config.json and no "
                              f"{SUBFOLDER}/ subfolder with a config.json")
    folder, cfg, where = found
    return build_dspark(model.config, cfg, read_tensors(folder, PREFIX), where).to(device=model.device, dtype=model.dtype)


def build_dspark(target_config, cfg: dict, tensors: dict, where: str) -> DSparkModule:
    """A DSparkModule from a config dict and its release-named tensors, every tensor checked."""
    settings = DSparkSettings.from_config(cfg, target_config, where)
    for key in STRUCTURE_KEYS:  # the stages are built from the target's config: a differing key would be ignored
        if key in cfg and cfg[key] != getattr(target_config, key):
            raise CheckpointError(f"{where}: {key} is {cfg[key]}, the target's is {getattr(target_config, key)} "
                                  "(the DSpark stages take the target's layer settings)")
    if not tensors:
        raise CheckpointError(f"{where}: the DSpark module has no {PREFIX}* tensors")
    module = DSparkModule(target_config, settings)
    n_exp = settings.n_routed_experts or target_config.n_routed_experts
    sd = module_state_dict(tensors, settings, n_exp, where)
    own = module.state_dict()
    missing = sorted(k for k in own if k not in sd and not k.endswith("inv_freq"))
    if missing:
        names = _release_name(missing[0], settings)
        raise CheckpointError(f"{where}: DSpark tensor {names} is missing ({len(missing)} module weights without a tensor)")
    for k, v in sd.items():
        if own[k].shape != v.shape:
            raise CheckpointError(f"{where}: DSpark tensor {_release_name(k, settings)} has shape {tuple(v.shape)}, "
                                  f"expected {tuple(own[k].shape)}")
    module.load_state_dict({k: v.to(own[k].dtype) for k, v in sd.items()}, strict=False)
    return module.eval()


def _release_name(module_name: str, settings: DSparkSettings) -> str:
    """A module weight's release name, for messages."""
    s_last = settings.num_stages - 1
    if module_name.startswith("stages."):
        _, s, rest = module_name.split(".", 2)
        for k, v in LAYER_TO_MODULE.items():
            if v == rest:
                return f"{PREFIX}{s}.{k}"
        return f"{PREFIX}{s}.ffn.experts.*"
    for table, stage in ((_FIRST, 0), (_LAST, s_last)):
        for k, v in table.items():
            if v == module_name:
                return f"{PREFIX}{stage}.{k}"
    return module_name


def write_dspark(directory, module: DSparkModule, target_config, extra=None) -> Path:
    """Write the module as a `dspark/` subfolder of `directory` (dense safetensors in the module's
    dtype and a config.json: the target's config plus the `dspark_*` keys), plus whatever
    `extra(folder)` writes there; written to a temporary sibling and renamed into place, so a
    failure leaves the old subfolder (or none). -> the subfolder."""

    sub = Path(directory) / SUBFOLDER
    with replaced_directory(sub) as tmp:
        save_file(to_checkpoint_names(module), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        cfg = target_config.to_dict()
        cfg.update(module.settings.to_config(), architectures=["DeepseekV4ForCausalLMDSpark"],
                   num_nextn_predict_layers=module.settings.num_stages)
        cfg.pop("torch_dtype", None)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
        if extra is not None:
            extra(tmp)
    return sub



def add_dspark_to_checkpoint(directory, module: DSparkModule) -> None:
    """Bundle the module into a one-file checkpoint: its tensors appended to
    directory/model.safetensors, its `dspark_*` keys to config.json (no `mtp.*` may be there)."""
    from safetensors.torch import load_file

    path = Path(directory) / "model.safetensors"
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: bundling appends to a one-file checkpoint; for a sharded or "
                              f"release-format one use write_release(..., dspark=module) or a {SUBFOLDER}/ subfolder")
    tensors = load_file(str(path))
    taken = sorted(k for k in tensors if k.startswith(PREFIX))
    if taken:
        raise CheckpointError(f"{path} already holds {taken[0]} (an MTP block?): bundle DSpark into a checkpoint "
                              f"without {PREFIX}* tensors, or write it as a {SUBFOLDER}/ subfolder (write_dspark)")
    tensors.update(to_checkpoint_names(module))
    cfg_path = Path(directory) / "config.json"
    cfg = read_config(Path(directory))
    cfg.update(module.settings.to_config(), num_nextn_predict_layers=module.settings.num_stages)
    # both files written beside their targets first, then renamed: the tensors never sit there
    # without the dspark_* keys that make them DSpark (they would read as an MTP block)
    save_file(tensors, str(path) + ".tmp", metadata={"format": "pt"})
    Path(str(cfg_path) + ".tmp").write_text(json.dumps(cfg, indent=2))
    os.replace(str(cfg_path) + ".tmp", cfg_path)
    os.replace(str(path) + ".tmp", path)
