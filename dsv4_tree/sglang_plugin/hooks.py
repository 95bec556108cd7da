"""The plug-in's hook functions (registered by `dsv4_tree.sglang_plugin.register`). Imports
SGLang 0.5.23 modules; loaded only inside SGLang processes.

* Argument gates: AROUND hooks on the two functions whose *last statement* refuses EAGLE
  topk > 1 for DeepSeek-V4 (so nothing after the refusal is skipped when it is lifted). The
  original runs first; only that refusal is caught, and only when the configuration is a
  DeepSeek-V4 tree that `validate_tree_settings` accepts. Any other model, or any other
  failure, propagates unchanged.
* Backend factories: AROUND hooks that return the tree-aware subclasses when topk > 1 and the
  originals' result otherwise.
* Commit: an AROUND hook on `_finalize_accept_tree_path` runs the tree commit (`commit.py`)
  around SGLang's own slot moves, as one transaction; one on the pool's
  `clear_unaccepted_c128_draft_states` skips SGLang's cleanup (it clears ring rows by node
  number) on pools the tree backend serves, whose commit clears the rejected rows itself; the
  skip is recorded on the pool and consumed by the commit (`commit.defer_c128_cleanup`). Both
  act only on a pool the tree backend prepared (`pool.dsv4_tree_scratch`); any other pool gets
  SGLang's code unchanged."""
from __future__ import annotations

import dataclasses
import logging

from ..errors import ConfigError
from .dspark_args import around_handle_dspark  # noqa: F401 (registered by name, __init__.HOOKS)
from .dspark_runtime import (around_get_alloc_len_per_decode, around_num_tokens_per_req_for_target_verify,  # noqa: F401
                             around_resolve_runtime_config)
from .dspark_worker import around_dspark_forward_decode, around_dspark_worker_init  # noqa: F401
from .grammar import around_process_req_with_grammar  # noqa: F401 (registered by name, __init__.HOOKS)
from .ring import around_resolve_compress_state_ring_size  # noqa: F401 (registered by name, __init__.HOOKS)
from .server_settings import settings_from_server_args  # noqa: F401 (tests read it here)
from .validate import DSV4_ARCHS, tree_requested, validate_tree_settings

logger = logging.getLogger(__name__)

DSV4_TOPK_REFUSAL = "topk == 1 is supported for"  # apply_deepseek_v4_defaults' assertion
PAGE_TREE_REFUSAL = "speculative_eagle_topk > 1 with page_size > 1"  # _handle_eagle_family's ValueError


def around_apply_deepseek_v4_defaults(original, server_args, model_arch):
    try:
        return original(server_args, model_arch)
    except AssertionError as exc:
        if DSV4_TOPK_REFUSAL not in str(exc) or model_arch not in DSV4_ARCHS:
            raise
        settings = settings_from_server_args(server_args)
        if not tree_requested(settings):
            raise
        validate_tree_settings(settings)
        logger.info("dsv4_tree: EAGLE topk=%d tree verify accepted for %s", settings.topk, model_arch)
        return None


def around_handle_eagle_family(original, server_args):
    try:
        return original(server_args)
    except ValueError as exc:
        if PAGE_TREE_REFUSAL not in str(exc):
            raise
        settings = settings_from_server_args(server_args)
        if not tree_requested(settings):
            raise
        if settings.dsv4_attn_backend == "auto":
            # resolved later by apply_deepseek_v4_defaults, which validates again with it set
            settings = dataclasses.replace(settings, dsv4_attn_backend="flashmla")
        validate_tree_settings(settings)
        return None


def _tree_topk(model_runner) -> int:
    from sglang.srt.runtime_context import get_spec

    return int(get_spec().speculative_eagle_topk or 0)


def _is_dspark_draft_runner(model_runner) -> bool:
    return bool(getattr(model_runner, "is_draft_worker", False)) and model_runner.spec_algorithm.is_dspark()


def around_create_deepseek_v4_attn_backend(original, model_runner, **kwargs):
    if _tree_topk(model_runner) <= 1:
        return original(model_runner, **kwargs)
    if _is_dspark_draft_runner(model_runner):
        # the DSpark draft runner keeps SGLang's own backend, built as for SGLang's DSpark chain of
        # the tree's gamma; only the target gets the tree backend
        from .backend import spec_view
        from .dspark_runtime import draft_spec_overrides

        with spec_view(**draft_spec_overrides()):
            return original(model_runner, **kwargs)
    from sglang.srt.layers.attention.deepseek_v4_trtllm_backend import (
        is_dsv4_mega_attn_enabled, is_dsv4_trtllm_attn_enabled)

    if is_dsv4_trtllm_attn_enabled() or is_dsv4_mega_attn_enabled():
        raise ConfigError("dsv4_tree tree verify: --dsv4-attn-backend must be 'flashmla'")
    from .backend import TreeDeepseekV4AttnBackend

    return TreeDeepseekV4AttnBackend(model_runner, **kwargs)


def around_create_deepseek_v4_multistep_backend(original, model_runner, topk, speculative_num_steps):
    if topk <= 1:
        return original(model_runner, topk=topk, speculative_num_steps=speculative_num_steps)
    if _is_dspark_draft_runner(model_runner):
        from .backend import spec_view
        from .dspark_runtime import draft_spec_overrides

        with spec_view(**draft_spec_overrides()):
            return original(model_runner, topk=1, speculative_num_steps=speculative_num_steps)
    from sglang.srt.layers.attention.deepseek_v4_trtllm_backend import is_dsv4_trtllm_attn_enabled

    if is_dsv4_trtllm_attn_enabled():
        raise ConfigError("dsv4_tree tree verify: --dsv4-attn-backend must be 'flashmla'")
    from .backend import TreeDeepseekV4MultiStepBackend

    return TreeDeepseekV4MultiStepBackend(model_runner, topk=topk, speculative_num_steps=speculative_num_steps)


def _tree_pool(pool) -> bool:
    return getattr(pool, "dsv4_tree_scratch", None) is not None


def around_finalize_accept_tree_path(original, batch, accept_index, accept_lens, predict, logits_output, bs, *,
                                     token_to_kv_pool_allocator, num_draft_tokens):
    def slot_moves():
        return original(batch, accept_index, accept_lens, predict, logits_output, bs,
                        token_to_kv_pool_allocator=token_to_kv_pool_allocator, num_draft_tokens=num_draft_tokens)

    pool = token_to_kv_pool_allocator.get_kvcache()
    if not _tree_pool(pool):
        return slot_moves()
    from .commit import c128_ring_size, plan_tree_commit, run_tree_commit, take_deferred_cleanup

    take_deferred_cleanup(pool)
    spec = batch.spec_info
    plan = plan_tree_commit(req_pool_indices=batch.req_pool_indices, seq_lens=batch.seq_lens,
                            retrieve_next_token=spec.retrieve_next_token,
                            retrieve_next_sibling=spec.retrieve_next_sibling, out_cache_loc=batch.out_cache_loc,
                            accept_index=accept_index, accept_lens=accept_lens, scratch=pool.dsv4_tree_scratch,
                            c128_ring=c128_ring_size(pool), full_to_swa=pool.full_to_swa_index_mapping)
    return run_tree_commit(pool, plan, slot_moves)


def around_clear_unaccepted_c128_draft_states(original, pool, *args, **kwargs):
    if _tree_pool(pool):
        from .commit import defer_c128_cleanup

        return defer_c128_cleanup(pool)  # the tree commit clears the rejected rows after moving the accepted ones
    return original(pool, *args, **kwargs)
