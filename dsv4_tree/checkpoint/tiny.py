"""The embedded tiny DeepSeek-V4 checkpoint: made deterministically (seeded) on first use.

Every layer type is present (sliding, C4/CSA with indexer, C128/HCA), hash-MoE and routed
MoE layers too. Unlike Hugging Face's initializer, the attention sinks, compressor position
biases, hash routing table and router correction bias get non-trivial random values: zeros
there would hide bugs in exactly the code tree verify changes."""
from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from ..hf_bindings import DeepseekV4Config, DeepseekV4ForCausalLM
from .files import release_complete, replaced_directory

TINY_NAME = "tiny-random-v2"
TINY_RELEASE_NAME = "tiny-release-v1"
TINY_SEED = 1234

TINY_CONFIG = dict(
    vocab_size=512,
    hidden_size=64,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=32,
    partial_rotary_factor=0.25,
    q_lora_rank=32,
    num_experts_per_tok=2,
    n_routed_experts=4,
    n_shared_experts=1,
    max_position_embeddings=4096,
    layer_types=[
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
    ],
    mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    sliding_window=32,
    hc_mult=2,
    o_groups=2,
    o_lora_rank=16,
    index_n_heads=8,
    index_head_dim=16,
    index_topk=8,
    num_nextn_predict_layers=1,
    bos_token_id=0,
    eos_token_id=1,
)


# The release-format tiny model: sides that are multiples of 128 so that nearly every linear
# weight spans several 128x128 FP8 scale blocks (q_b 512x256, o_a / o_b / wq_a 256x256, ...);
# a short window and HCA ratio so every attention branch is reached by short test prompts.
RELEASE_TINY_OVERRIDES = dict(
    hidden_size=256,
    q_lora_rank=256,
    head_dim=128,
    o_lora_rank=128,
    moe_intermediate_size=128,
    index_n_heads=4,
    index_head_dim=64,
    sliding_window=16,
    compress_rates={"heavily_compressed_attention": 16},
    max_position_embeddings=512,
)


def tiny_config(**overrides) -> DeepseekV4Config:
    """The tiny config, with overrides (tests use e.g. sliding_window=8 and an HCA ratio of 16)."""
    kwargs = {**TINY_CONFIG, **overrides}
    if "compress_rates" in overrides:
        kwargs["compress_rates"] = {**TINY_CONFIG["compress_rates"], **overrides["compress_rates"]}
    return DeepseekV4Config(**kwargs)


def _fill(name: str, t: torch.Tensor, g: torch.Generator, num_experts: int) -> None:
    def normal(std):
        return torch.randn(t.shape, generator=g) * std

    leaf = name.rsplit(".", 1)[-1]
    if leaf == "tid2eid":
        rows = [torch.randperm(num_experts, generator=g)[: t.shape[1]] for _ in range(t.shape[0])]
        t.copy_(torch.stack(rows))
    elif leaf == "sinks" or leaf == "position_bias":
        t.copy_(normal(1.0))
    elif leaf == "e_score_correction_bias":
        t.copy_(normal(0.1))
    elif leaf in ("base", "hc_base"):
        t.copy_(normal(0.5))
    elif leaf in ("scale", "hc_scale"):
        t.copy_(1.0 + normal(0.1))
    elif leaf in ("fn", "hc_fn"):
        t.copy_(normal(0.05))
    elif "norm" in name and leaf == "weight":
        t.copy_(1.0 + normal(0.1))
    elif "embed_tokens" in name:
        t.copy_(normal(1.0))
    elif leaf in ("gate_up_proj", "down_proj") and t.dim() == 3:
        t.copy_(normal(1.0 / math.sqrt(t.shape[-1])))
    elif t.dim() == 2:
        t.copy_(normal(1.0 / math.sqrt(t.shape[-1])))
    else:
        t.copy_(normal(0.1))


def random_model(config: DeepseekV4Config, seed: int = TINY_SEED) -> DeepseekV4ForCausalLM:
    """A DeepseekV4ForCausalLM with seeded random weights (fp32, CPU), deterministic by name."""
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(config).eval()
    g = torch.Generator().manual_seed(seed)
    named = dict(model.named_parameters())
    named.update({n: b for n, b in model.named_buffers() if n.endswith(("tid2eid", "e_score_correction_bias"))})
    with torch.no_grad():
        for name in sorted(named):
            _fill(name, named[name], g, config.n_routed_experts)
    return model


def zero_model(config: DeepseekV4Config) -> DeepseekV4ForCausalLM:
    """A DeepseekV4ForCausalLM of `config` (fp32, CPU) with every weight zero but its hash-routing
    tables (tid2eid: valid expert ids, seeded): for recording kernel launches (dsv4_tree/aot),
    where no weight value reaches what is recorded. No init pass: at V4-Flash dims it takes under a
    second where random_model takes about 12."""
    from transformers.initialization import no_init_weights

    with no_init_weights():
        model = DeepseekV4ForCausalLM(config).eval()
    g = torch.Generator().manual_seed(TINY_SEED)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("tid2eid"):
                _fill(name, t, g, config.n_routed_experts)
            elif t.is_floating_point() and not name.endswith("inv_freq"):  # the RoPE tables stay as built
                t.zero_()
    return model


def random_mtp(config: DeepseekV4Config, seed: int = TINY_SEED):
    """A seeded random MTP block for `config` (same value rules as the main weights)."""
    from .mtp import MtpBlock

    torch.manual_seed(seed + 1)
    block = MtpBlock(config).eval()
    g = torch.Generator().manual_seed(seed + 1)
    named = dict(block.named_parameters())
    named.update({n: b for n, b in block.named_buffers() if n.endswith("e_score_correction_bias")})
    with torch.no_grad():
        for name in sorted(named):
            _fill(name, named[name], g, config.n_routed_experts)
    return block


def random_dspark(config: DeepseekV4Config, settings, seed: int = TINY_SEED):
    """A seeded random DSpark module for `config` with `settings` (a DSparkSettings; same value
    rules as the main weights)."""
    from .dspark import DSparkModule

    torch.manual_seed(seed + 2)
    module = DSparkModule(config, settings).eval()
    g = torch.Generator().manual_seed(seed + 2)
    named = dict(module.named_parameters())
    named.update({n: b for n, b in module.named_buffers() if n.endswith("e_score_correction_bias")})
    with torch.no_grad():
        for name in sorted(named):
            _fill(name, named[name], g, settings.n_routed_experts or config.n_routed_experts)
    return module


def write_random_checkpoint(directory, config: DeepseekV4Config | None = None, seed: int = TINY_SEED,
                            with_mtp: bool = True) -> Path:
    """Write a seeded random checkpoint (config.json + model.safetensors, with mtp.* tensors
    in DeepSeek's naming unless with_mtp=False) to `directory`."""
    from .mtp import add_mtp_to_checkpoint

    directory = Path(directory)
    config = config or tiny_config()
    model = random_model(config, seed)
    with replaced_directory(directory) as tmp:
        model.save_pretrained(str(tmp), safe_serialization=True)
        if with_mtp:
            add_mtp_to_checkpoint(tmp, random_mtp(config, seed))
    return directory


def default_home() -> Path:
    return Path(os.environ.get("DSV4_TREE_HOME", Path.home() / ".cache" / "dsv4_tree"))


def tiny_checkpoint(directory=None, format: str = "hf") -> Path:
    """Directory of the embedded tiny random checkpoint, created (seeded) if missing.
    format="hf": Hugging Face names, fp32, one file. format="release": DeepSeek's release format
    (DeepSeek names, FP8 block-scaled linears, FP4 experts, MTP block, sharded; see release.py)."""
    if format == "hf":
        directory = Path(directory) if directory is not None else default_home() / TINY_NAME
        if not ((directory / "config.json").is_file() and (directory / "model.safetensors").is_file()):
            write_random_checkpoint(directory)
        return directory
    if format == "release":
        from .release import write_release

        directory = Path(directory) if directory is not None else default_home() / TINY_RELEASE_NAME
        if not release_complete(directory):
            config = tiny_config(**RELEASE_TINY_OVERRIDES)
            write_release(directory, random_model(config), random_mtp(config))
        return directory
    from ..errors import InputError

    raise InputError(f"format must be 'hf' or 'release', got {format!r}")


TRAINED_DIR = Path(__file__).resolve().parent.parent / "checkpoints" / "tiny-stdlib-bytes"


def trained_checkpoint() -> Path:
    """Directory of the shipped trained byte-level checkpoint (with MTP weights); the default
    of the demo and `generate`. Tests use the random `tiny_checkpoint()`."""
    if not (TRAINED_DIR / "config.json").is_file():
        from ..errors import CheckpointError

        raise CheckpointError(f"the trained checkpoint is missing from {TRAINED_DIR} (a damaged install?)")
    return TRAINED_DIR
