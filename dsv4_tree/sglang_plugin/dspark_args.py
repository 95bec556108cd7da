"""Server arguments of a DSpark tree: `--speculative-algorithm DSPARK --speculative-eagle-topk K`
(K > 1) on DeepSeek-V4, through an AROUND hook on SGLang 0.5.23's `_handle_dspark`.

SGLang's `_handle_dspark` forces topk 1 and one step, resolves gamma (the block size: the flag,
else the checkpoint, else 7) and requires `--speculative-num-draft-tokens == gamma + 1`. For a
DeepSeek-V4 target with topk > 1 the hook runs it with the verify width left to SGLang (so its
gamma resolution, draft-path defaults and warnings are SGLang's own), then declares the tree's
settings on top (SGLang's declarations are last-writer-wins): topk K, N = the requested
`--speculative-num-draft-tokens` (default gamma + 1), the resolved gamma as
`speculative_dspark_block_size` (read by the worker-side hooks in every process), and keeps
SGLang's num_steps 1 (the tree's depth is gamma). The validator then accepts the tree or raises
a ConfigError naming the setting. topk <= 1, and any other model, get SGLang's function alone."""
from __future__ import annotations

import dataclasses
import logging

from .validate import DSV4_ARCHS, validate_tree_settings
from .server_settings import settings_from_server_args

logger = logging.getLogger(__name__)

SOURCE = "dsv4_tree._handle_dspark"
V41_MODEL_TYPE = "deepseek_v41"


def dspark_tree_requested(server_args) -> bool:
    """topk > 1 on a DeepSeek-V4 (or V4.1, refused by name) target."""
    from sglang.srt.arg_groups.overrides import model_config_of, resolving_view

    cfg = resolving_view(server_args)
    if int(cfg.speculative_eagle_topk or 0) <= 1:
        return False
    hf_config = model_config_of(server_args).hf_config
    arch = (getattr(hf_config, "architectures", None) or [""])[0]
    return arch in DSV4_ARCHS or getattr(hf_config, "model_type", None) == V41_MODEL_TYPE


def around_handle_dspark(original, server_args):
    if not dspark_tree_requested(server_args):
        return original(server_args)
    from sglang.srt.arg_groups.overrides import declare_resolution, resolving_view

    cfg = resolving_view(server_args)
    topk, requested = int(cfg.speculative_eagle_topk), cfg.speculative_num_draft_tokens
    # SGLang's resolution with the verify width left to it: it resolves gamma and N = gamma + 1
    declare_resolution(server_args, SOURCE, speculative_num_draft_tokens=None)
    original(server_args)
    gamma = int(resolving_view(server_args).speculative_num_draft_tokens) - 1
    n = gamma + 1 if requested is None else int(requested)
    declare_resolution(server_args, SOURCE, speculative_eagle_topk=topk, speculative_num_draft_tokens=n,
                       speculative_dspark_block_size=gamma)
    settings = settings_from_server_args(server_args)
    if settings.dsv4_attn_backend == "auto":
        # resolved later by apply_deepseek_v4_defaults; the backend factory refuses anything but flashmla
        settings = dataclasses.replace(settings, dsv4_attn_backend="flashmla")
    validate_tree_settings(settings)
    logger.info("dsv4_tree: DSPARK tree accepted (topk=%d, gamma=%d, %d verify tokens)", topk, gamma, n)
