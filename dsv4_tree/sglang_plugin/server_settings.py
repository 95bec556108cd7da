"""The resolved SGLang settings the tree path depends on, read from SGLang's server arguments
(`settings_from_server_args`, what the validator checks), with the two readings it needs: the
tree path's draft-token bound (`ring.tree_draft_token_capacity`) and the DSpark options the tree
step does not run. Imported by the argument hooks of both algorithms (hooks.py, dspark_args.py)."""
from __future__ import annotations

from .ring import tree_draft_token_capacity
from .validate import TreeServeSettings
from .validate_dspark import UNSUPPORTED_OPTIONS


def settings_from_server_args(server_args) -> TreeServeSettings:
    from sglang.srt.arg_groups.overrides import model_config_of, resolving_view
    from sglang.srt.environ import envs
    from sglang.srt.layers.attention.dsv4.unified_kv_gate import is_unified_kv_triton

    cfg = resolving_view(server_args)
    hf_config = model_config_of(server_args).hf_config
    archs = getattr(hf_config, "architectures", None) or [""]
    n = int(cfg.speculative_num_draft_tokens or 0)
    return TreeServeSettings(
        model_arch=archs[0], speculative_algorithm=cfg.speculative_algorithm,
        topk=int(cfg.speculative_eagle_topk or 0), num_steps=int(cfg.speculative_num_steps or 0), num_draft_tokens=n,
        dsv4_attn_backend=str(cfg.dsv4_attn_backend), disable_cuda_graph=bool(cfg.disable_cuda_graph),
        attn_cp_size=int(cfg.attn_cp_size or 1), dcp_size=int(cfg.dcp_size or 1),
        enable_prefill_cp=bool(cfg.enable_prefill_cp),
        encoder_swa_bounded_replay=bool(cfg.enable_encoder_swa_bounded_replay),
        unified_kv=is_unified_kv_triton(), online_compress=bool(envs.SGLANG_OPT_USE_ONLINE_COMPRESS.get()),
        ragged_verify_mode=str(envs.SGLANG_RAGGED_VERIFY_MODE.get()), draft_token_capacity=tree_draft_token_capacity(),
        pp_size=int(cfg.pp_size or 1), multi_layer_eagle=bool(cfg.enable_multi_layer_eagle),
        hisparse=bool(cfg.enable_hisparse), hierarchical_cache=bool(cfg.enable_hierarchical_cache),
        disaggregation_mode=str(cfg.disaggregation_mode or "null"),
        debug_cuda_graph=bool(getattr(cfg, "debug_cuda_graph", False)),
        metadata_glue=bool(envs.SGLANG_ENABLE_METADATA_GLUE_GRAPH.get()),
        two_batch_overlap=bool(cfg.enable_two_batch_overlap),
        accept_threshold_single=float(cfg.speculative_accept_threshold_single),
        accept_threshold_acc=float(cfg.speculative_accept_threshold_acc),
        model_type=str(getattr(hf_config, "model_type", "")), gamma=int(cfg.speculative_dspark_block_size or 0),
        attn_dp_size=int(cfg.attn_dp_size or 1),
        unsupported=unsupported_options(cfg) if cfg.speculative_algorithm == "DSPARK" else (),
    )


def _env_value(name: str):
    from sglang.srt.environ import envs

    return getattr(envs, name).get()


def unsupported_options(cfg) -> tuple:
    """Names (with the value each must have) of the DSpark options set that the tree step does not
    run (validate_dspark.UNSUPPORTED_OPTIONS); cfg: SGLang's resolving view."""
    flags = {"--speculative-use-rejection-sampling": bool(cfg.speculative_use_rejection_sampling),
             "--speculative-use-block-verification": bool(cfg.speculative_use_block_verification)}
    out = []
    for name, want, why in UNSUPPORTED_OPTIONS:
        if name.startswith("--"):
            bad = flags[name]
        elif name == "SGLANG_SIMULATE_ACC_LEN":
            bad = float(_env_value(name)) > 0
        else:
            bad = bool(_env_value(name))
        if bad:
            out.append(f"{name} (must be {want}: {why})")
    return tuple(out)
