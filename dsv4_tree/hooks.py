"""Config hooks: pure functions of (model config, SpecConfig) deciding what can be served.

They never touch tensors or the engine; every refusal is a ConfigError naming the field
and the limit it broke."""
from __future__ import annotations

from dataclasses import dataclass

from .config import ACCEPT_ALGORITHMS, ATTENTION_BACKENDS, KV_CACHE_DTYPES, MASK_MODES, SpecConfig
from .errors import ConfigError

SUPPORTED_LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
BITPACK_MAX_NODES = 32


def candidate_pool_size(topk: int, num_steps: int) -> int:
    """Draft candidates an EAGLE expansion produces: topk + (num_steps - 1) * topk^2."""
    return topk + (num_steps - 1) * topk * topk


@dataclass(frozen=True)
class ServingPlan:
    """What the hooks decided: the resolved limits every verify call is checked against."""

    tree_mode: bool  # eagle_topk > 1
    max_nodes: int  # num_draft_tokens
    max_depth: int  # num_steps
    max_positions: int  # model's max_position_embeddings


def validate_spec(model_config, spec: SpecConfig) -> ServingPlan:
    """Check `spec` against `model_config` (a transformers DeepseekV4Config)."""
    if spec.eagle_topk < 1:
        raise ConfigError(f"eagle_topk must be >= 1, got {spec.eagle_topk}")
    if spec.num_steps < 1:
        raise ConfigError(f"num_steps must be >= 1, got {spec.num_steps}")
    if spec.prefill_chunk < 1:
        raise ConfigError(f"prefill_chunk must be >= 1, got {spec.prefill_chunk}")
    if spec.num_draft_tokens is None:
        raise ConfigError(
            f"num_draft_tokens must be set when eagle_topk > 1 (eagle_topk={spec.eagle_topk}); "
            f"it may be at most {candidate_pool_size(spec.eagle_topk, spec.num_steps) + 1}"
        )
    if spec.num_draft_tokens < 1:
        raise ConfigError(f"num_draft_tokens must be >= 1, got {spec.num_draft_tokens}")
    if spec.eagle_topk == 1:
        if spec.num_draft_tokens > spec.num_steps + 1:
            raise ConfigError(
                f"num_draft_tokens={spec.num_draft_tokens} exceeds num_steps + 1 = {spec.num_steps + 1} "
                "for a chain (eagle_topk=1)"
            )
    else:
        pool = candidate_pool_size(spec.eagle_topk, spec.num_steps)
        if spec.num_draft_tokens > pool + 1:
            raise ConfigError(
                f"num_draft_tokens={spec.num_draft_tokens} exceeds the candidate pool + root = {pool + 1} "
                f"(eagle_topk={spec.eagle_topk}, num_steps={spec.num_steps}: topk + (num_steps-1)*topk^2 = {pool})"
            )
    if spec.mask_mode not in MASK_MODES:
        raise ConfigError(f"mask_mode={spec.mask_mode!r} is unknown; choose one of {MASK_MODES}")
    if spec.mask_mode == "QLEN_ONLY_BITPACKING" and spec.num_draft_tokens > BITPACK_MAX_NODES:
        raise ConfigError(
            f"mask_mode=QLEN_ONLY_BITPACKING holds at most {BITPACK_MAX_NODES} nodes per row; "
            f"num_draft_tokens={spec.num_draft_tokens}"
        )
    if spec.attention_backend not in ATTENTION_BACKENDS:
        raise ConfigError(
            f"attention_backend={spec.attention_backend!r} is not available; choose one of {ATTENTION_BACKENDS}"
        )
    if spec.accept not in ACCEPT_ALGORITHMS:
        raise ConfigError(f"accept={spec.accept!r} is unknown; choose one of {ACCEPT_ALGORITHMS}")
    if spec.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(f"kv_cache_dtype={spec.kv_cache_dtype!r} is unknown; choose one of {KV_CACHE_DTYPES}")
    if spec.page_size < 1 or spec.page_size & (spec.page_size - 1):
        raise ConfigError(f"page_size must be a power of two, got {spec.page_size}")
    if spec.max_requests < 1:
        raise ConfigError(f"max_requests must be >= 1, got {spec.max_requests}")
    if spec.cuda_graph_max_bs is not None and not 0 <= spec.cuda_graph_max_bs <= spec.max_requests:
        raise ConfigError(f"cuda_graph_max_bs must lie in [0, max_requests={spec.max_requests}], got {spec.cuda_graph_max_bs}")
    if spec.max_total_tokens is not None and spec.max_total_tokens < 1:
        raise ConfigError(f"max_total_tokens must be >= 1, got {spec.max_total_tokens}")
    _validate_model(model_config)
    for layer_type, ratio in model_config.compress_rates.items():
        if layer_type in model_config.layer_types and spec.page_size % ratio and ratio % spec.page_size:
            raise ConfigError(
                f"page_size={spec.page_size} and compress_rates[{layer_type!r}]={ratio} must divide one another"
            )
    if spec.num_steps + 1 >= model_config.max_position_embeddings:
        raise ConfigError(
            f"num_steps={spec.num_steps} leaves no room under max_position_embeddings="
            f"{model_config.max_position_embeddings}"
        )
    return ServingPlan(
        tree_mode=spec.eagle_topk > 1,
        max_nodes=spec.num_draft_tokens,
        max_depth=spec.num_steps,
        max_positions=model_config.max_position_embeddings,
    )


def _validate_model(cfg) -> None:
    if getattr(cfg, "model_type", None) != "deepseek_v4":
        raise ConfigError(f"model_type must be 'deepseek_v4', got {getattr(cfg, 'model_type', None)!r}")
    bad = [t for t in cfg.layer_types if t not in SUPPORTED_LAYER_TYPES]
    if bad:
        raise ConfigError(f"layer_types {bad} are not supported; supported: {SUPPORTED_LAYER_TYPES}")
    if cfg.num_key_value_heads != 1:
        raise ConfigError(f"num_key_value_heads must be 1 (shared-KV MQA), got {cfg.num_key_value_heads}")
    if cfg.sliding_window < 1:
        raise ConfigError(f"sliding_window must be >= 1, got {cfg.sliding_window}")
    for layer_type, ratio in cfg.compress_rates.items():
        if layer_type in cfg.layer_types and ratio < 2:
            raise ConfigError(f"compress_rates[{layer_type!r}] must be >= 2, got {ratio}")
