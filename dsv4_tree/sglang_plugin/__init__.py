"""SGLang 0.5.23 plug-in: tree verify (EAGLE or DSPARK, topk > 1) for DeepSeek-V4 inside SGLang.

SGLang loads this through the entry point `[project.entry-points."sglang.srt.plugins"]
dsv4_tree` and calls `register()` in every process it starts; `register()` records hooks in
SGLang's `HookRegistry`, which SGLang applies right after (design_notes/sglang-plugin.md lists
every hook). Any SGLang other than 0.5.23 gets one log line and no hooks: the hooks name
SGLang internals by dotted path and rely on 0.5.23's code around them.

Importing this package imports nothing of SGLang (nor transformers); the hook modules load
inside `register()`."""
from __future__ import annotations

import importlib.metadata
import logging

SUPPORTED_SGLANG = "0.5.23"

logger = logging.getLogger(__name__)

# (target, hook type, our function in dsv4_tree.sglang_plugin.hooks)
HOOKS = (
    ("sglang.srt.arg_groups.deepseek_v4_hook.apply_deepseek_v4_defaults", "AROUND", "around_apply_deepseek_v4_defaults"),
    ("sglang.srt.arg_groups.speculative_hook._handle_eagle_family", "AROUND", "around_handle_eagle_family"),
    ("sglang.srt.arg_groups.speculative_hook._handle_dspark", "AROUND", "around_handle_dspark"),
    ("sglang.srt.layers.attention.deepseek_v4_trtllm_backend.create_deepseek_v4_attn_backend", "AROUND",
     "around_create_deepseek_v4_attn_backend"),
    ("sglang.srt.layers.attention.deepseek_v4_trtllm_backend.create_deepseek_v4_multistep_backend", "AROUND",
     "around_create_deepseek_v4_multistep_backend"),
    ("sglang.srt.speculative.eagle_worker_common._finalize_accept_tree_path", "AROUND",
     "around_finalize_accept_tree_path"),
    ("sglang.srt.mem_cache.deepseek_v4_memory_pool.DeepSeekV4TokenToKVPool.clear_unaccepted_c128_draft_states",
     "AROUND", "around_clear_unaccepted_c128_draft_states"),
    # the C4 state ring of a tree window wider than SGLang's ring serves (ring.py)
    ("sglang.srt.mem_cache.deepseek_v4_memory_pool.resolve_compress_state_ring_size", "AROUND",
     "around_resolve_compress_state_ring_size"),
    # DSpark trees (dspark_runtime.py, dspark_worker.py)
    ("sglang.srt.speculative.dspark_components.dspark_config.resolve_runtime_config", "AROUND",
     "around_resolve_runtime_config"),
    ("sglang.srt.speculative.spec_info.SpeculativeAlgorithm.get_num_tokens_per_req_for_target_verify", "AROUND",
     "around_num_tokens_per_req_for_target_verify"),
    ("sglang.srt.mem_cache.allocation_sizing.get_alloc_len_per_decode", "AROUND", "around_get_alloc_len_per_decode"),
    ("sglang.srt.speculative.dspark_components.dspark_worker_v2.DSparkWorkerV2.__init__", "AROUND",
     "around_dspark_worker_init"),
    ("sglang.srt.speculative.dspark_components.dspark_worker_v2.DSparkWorkerV2._forward_decode", "AROUND",
     "around_dspark_forward_decode"),
    # a grammar-guided request on a DSpark-tree server finishes at admission (grammar.py)
    ("sglang.srt.constrained.grammar_manager.GrammarManager.process_req_with_grammar", "AROUND",
     "around_process_req_with_grammar"),
)
HOOK_TARGETS = tuple(target for target, _, _ in HOOKS)


def installed_sglang_version() -> str | None:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def register() -> bool:
    """SGLang's plug-in entry point. Returns whether the hooks were registered."""
    version = installed_sglang_version()
    if version != SUPPORTED_SGLANG:
        logger.warning("dsv4_tree SGLang plug-in: supports sglang==%s only, found %s; no hooks registered "
                       "(EAGLE topk > 1 stays refused for DeepSeek-V4)", SUPPORTED_SGLANG, version)
        return False
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from . import hooks

    for target, kind, name in HOOKS:
        HookRegistry.register(target, getattr(hooks, name), getattr(HookType, kind))
    install_move_kv_cache()
    return True


def install_move_kv_cache() -> None:
    """SGLang 0.5.23's `DeepSeekV4TokenToKVPool` has no `move_kv_cache`, which EAGLE topk > 1
    calls on the target pool (commit) and the draft pool (`duplicate_prefix_tail_to_draft_branches`).
    The hook registry cannot add a missing attribute, so it is set here with a plain setattr
    (`commit.move_kv_cache`)."""
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool

    from .commit import move_kv_cache

    DeepSeekV4TokenToKVPool.move_kv_cache = move_kv_cache
