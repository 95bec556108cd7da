"""Which SGLang configurations the tree-verify plug-in accepts: a pure check over the settings
that decide the DeepSeek-V4 verify path, one ConfigError naming the first setting outside it.

Two draft algorithms reach the tree verify: EAGLE (SGLang's multi-step MTP draft, topk > 1)
and DSPARK (DeepSeek's block drafter, whose Markov tree the plug-in's decode step drafts;
`validate_dspark.py` holds its own checks). Both share the checks of the target's verify path."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from ..hooks import candidate_pool_size

DSV4_ARCHS = ("DeepseekV4ForCausalLM",)
TREE_ALGORITHMS = ("EAGLE", "DSPARK")


@dataclass(frozen=True)
class TreeServeSettings:
    """The resolved SGLang settings the tree path depends on (`settings_from_server_args`)."""
    model_arch: str
    speculative_algorithm: str | None
    topk: int
    num_steps: int  # --speculative-num-steps (draft steps per round; DSPARK: 1, its depth is gamma)
    num_draft_tokens: int
    dsv4_attn_backend: str
    disable_cuda_graph: bool
    attn_cp_size: int
    dcp_size: int
    enable_prefill_cp: bool
    encoder_swa_bounded_replay: bool  # SGLang's per-request SWA window (not paged SWA)
    unified_kv: bool  # the HIP unified KV pool (not paged SWA)
    online_compress: bool  # SGLANG_OPT_USE_ONLINE_COMPRESS (online C128 state)
    ragged_verify_mode: str  # SGLANG_RAGGED_VERIFY_MODE
    draft_token_capacity: int  # most draft tokens per request the tree path serves (ring.tree_draft_token_capacity)
    pp_size: int = 1  # pipeline parallelism: non-last stages commit through move_kv_cache alone
    multi_layer_eagle: bool = False  # --enable-multi-layer-eagle: verify without _finalize_accept_tree_path
    hisparse: bool = False  # --enable-hisparse: caches the C4 buffers' addresses before they grow
    hierarchical_cache: bool = False  # --enable-hierarchical-cache: host copies of the device buffers
    disaggregation_mode: str = "null"  # PD disaggregation registers the buffers' addresses
    debug_cuda_graph: bool = False  # --debug-cuda-graph: SGLang's breakable graphs (a prep the tree backend lacks)
    metadata_glue: bool = False  # SGLANG_ENABLE_METADATA_GLUE_GRAPH: replays a captured metadata prep
    two_batch_overlap: bool = False  # --enable-two-batch-overlap: splits the batch, wraps the attention backend
    accept_threshold_single: float = 1.0  # --speculative-accept-threshold-single (sampling)
    accept_threshold_acc: float = 1.0  # --speculative-accept-threshold-acc (sampling)
    # DSPARK only (validate_dspark.py)
    model_type: str = "deepseek_v4"  # the target's hf model_type (deepseek_v41: DeepSeek-V4.1)
    gamma: int = 0  # the DSpark block size (draft rows per round, the tree's depth)
    attn_dp_size: int = 1  # DP attention
    unsupported: tuple = ()  # names of the set DSpark options the tree step does not run (envs, flags)


def tree_requested(s: TreeServeSettings) -> bool:
    return s.model_arch in DSV4_ARCHS and s.speculative_algorithm in TREE_ALGORITHMS and s.topk > 1


def verify_path_checks(s: TreeServeSettings) -> tuple:
    """(ok, message) of every setting the target's tree verify (either draft algorithm) needs."""
    return (
        (s.dsv4_attn_backend == "flashmla", f"--dsv4-attn-backend must be 'flashmla', got {s.dsv4_attn_backend!r}"),
        (s.disable_cuda_graph or not s.debug_cuda_graph,
         "--debug-cuda-graph is not supported (SGLang's breakable CUDA graphs re-plan the metadata through "
         "prepare_forward_metadata_for_breakable_cuda_graph_replay, which the tree backend does not implement; "
         "plain CUDA graphs and --disable-cuda-graph are)"),
        (not s.metadata_glue,
         "SGLANG_ENABLE_METADATA_GLUE_GRAPH=1 is not supported (its glue graph replays the target-verify "
         "metadata prep by address; the tree backend's prep copies the round's tree from the live verify input, "
         "so a replay would keep the capture round's tree)"),
        (not s.two_batch_overlap,
         "--enable-two-batch-overlap is not supported (it splits a verify batch in two and wraps the attention "
         "backend per half; the tree metadata is built for the whole batch's rows, and no test shows a split "
         "batch's tree rows equal the unsplit batch's)"),
        (s.accept_threshold_single == 1.0 and s.accept_threshold_acc == 1.0,
         f"--speculative-accept-threshold-single / --speculative-accept-threshold-acc must stay 1.0 with trees "
         f"(got {s.accept_threshold_single} / {s.accept_threshold_acc}): below 1.0 SGLang's tree sampling accepts "
         f"draft tokens the target would not have sampled, so sampled output is no longer lossless"),
        (s.attn_cp_size == 1, f"attention context parallelism is not supported (attn_cp_size={s.attn_cp_size}, must be 1)"),
        (s.dcp_size == 1, f"decode context parallelism is not supported (dcp_size={s.dcp_size}, must be 1)"),
        (not s.enable_prefill_cp, "--enable-prefill-cp is not supported"),
        (not s.encoder_swa_bounded_replay, "--enable-encoder-swa-bounded-replay is not supported (needs paged SWA)"),
        (not s.unified_kv, "the unified KV pool (SGLANG_HACK_FLASHMLA_BACKEND=unified_kv_triton) is not supported "
                           "(needs paged SWA)"),
        (not s.online_compress, "SGLANG_OPT_USE_ONLINE_COMPRESS=1 (online C128) is not supported"),
        (s.ragged_verify_mode == "static",
         f"SGLANG_RAGGED_VERIFY_MODE must be 'static', got {s.ragged_verify_mode!r}"),
        (s.pp_size == 1, f"pipeline parallelism is not supported (pp_size={s.pp_size}, must be 1: SGLang's "
                         f"non-last stages commit accepted tokens without the tree commit)"),
        (not s.hisparse, "--enable-hisparse is not supported (HiSparse caches the C4 buffers' addresses, which "
                         "the tree backend's scratch pages replace)"),
        (not s.hierarchical_cache, "--enable-hierarchical-cache is not supported (HiCache mirrors the device "
                                   "buffers, which the tree backend's scratch pages replace)"),
        (s.disaggregation_mode == "null", f"PD disaggregation is not supported (disaggregation_mode="
                                          f"{s.disaggregation_mode!r}, must be 'null': it registers the buffers' "
                                          f"addresses, which the tree backend's scratch pages replace)"),
        (2 <= s.num_draft_tokens <= s.draft_token_capacity,
         f"--speculative-num-draft-tokens must be in [2, {s.draft_token_capacity}] (one request's tree scratch "
         f"slots fit two C4 index pages of 64; the C4 compressor-state ring is grown past SGLang's 16 rows per "
         f"SWA page for windows over 10, to 32 rows up to 26, 64 up to 58, 128 beyond), got {s.num_draft_tokens}"),
    )


def eagle_checks(s: TreeServeSettings) -> tuple:
    # the draft's candidates per request (SGLang's select_top_k_tokens: topk at step 0, topk^2 at
    # every later step), of which organize_draft_results' torch.topk takes num_draft_tokens - 1;
    # the engine's own rule (dsv4_tree.hooks.validate_spec)
    pool = candidate_pool_size(s.topk, max(s.num_steps, 1))
    return (
        (not s.multi_layer_eagle, "--enable-multi-layer-eagle is not supported (its verify skips "
                                  "_finalize_accept_tree_path, where the tree commit runs)"),
        (s.num_steps >= 1, f"--speculative-num-steps must be >= 1, got {s.num_steps}"),
        (s.num_draft_tokens - 1 <= pool,
         f"--speculative-num-draft-tokens {s.num_draft_tokens} needs {s.num_draft_tokens - 1} draft candidates, "
         f"more than SGLang's organize_draft_results selects from (topk + (num_steps - 1) * topk^2 = {pool} "
         f"with --speculative-num-steps {s.num_steps}), so at most {pool + 1}: raise --speculative-num-steps "
         f"or lower --speculative-num-draft-tokens"),
    )


def validate_tree_settings(s: TreeServeSettings) -> None:
    """Raise ConfigError unless DeepSeek-V4 tree verify (topk > 1, EAGLE or DSPARK) runs on the
    path this plug-in builds metadata for; the message names the setting and what it must be."""
    if s.speculative_algorithm not in TREE_ALGORITHMS or s.topk <= 1:
        raise ConfigError(f"dsv4_tree tree verify needs --speculative-algorithm EAGLE or DSPARK with "
                          f"--speculative-eagle-topk > 1, got {s.speculative_algorithm!r} topk={s.topk}")
    arch = ((s.model_arch in DSV4_ARCHS, f"model architecture {s.model_arch!r} is not one of {DSV4_ARCHS}"),)
    if s.speculative_algorithm == "DSPARK":
        from .validate_dspark import dspark_checks, model_type_check

        checks = (model_type_check(s),) + arch + dspark_checks(s)  # V4.1 is refused by its model_type
    else:
        checks = arch + eagle_checks(s)
    for ok, message in checks + verify_path_checks(s):
        if not ok:
            raise ConfigError(f"dsv4_tree tree verify ({s.speculative_algorithm} topk={s.topk}): {message}")
