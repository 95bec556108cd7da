"""The checks a DSpark tree (`--speculative-algorithm DSPARK --speculative-eagle-topk K > 1`) adds
to the tree verify's (`validate.py`): pure functions of the resolved settings.

The tree decode step (`dspark_step.py`) drafts one Markov tree per request from SGLang's own
backbone pass, verifies it through the tree backend, accepts and commits with SGLang's tree code
and commits the draft context from the accepted nodes. What it does not run is refused here by
name: DeepSeek-V4.1 (its layer loop and serving extras are not covered), DP attention, and every
SGLang option that folds chain-only work into
graphs or kernels (the folded proposal and its megakernel, the verify epilogues, the deferred
context commit, block-wise or rejection sampling, simulated acceptance, the early verify
metadata), listed in `settings.unsupported`. Any grammar backend is accepted: a request that
carries a grammar is refused at admission (`grammar.py`), the others are served as trees."""
from __future__ import annotations

from ..hooks import candidate_pool_size

DSPARK_MODEL_TYPES = ("deepseek_v4",)

# SGLang options (environment variables and server arguments) the tree step does not run, with
# the value each must have; `dspark_args.unsupported_options` reads them.
UNSUPPORTED_OPTIONS = (
    ("SGLANG_DSPARK_FOLDED_PROPOSAL", "0", "the draft graph's folded Markov proposal (and its megakernel) "
                                           "draws a chain"),
    ("SGLANG_DSPARK_DEFER_CONTEXT_KV", "0", "the deferred context commit gates rows by chain column"),
    ("SGLANG_OPT_DSV41_TARGET_METADATA_EARLY", "0", "the early verify metadata stages a chain verify"),
    ("SGLANG_OPT_DSV41_DSPARK_PREPARE_INPUTS_ONCE", "0", "it writes the chain's verify inputs"),
    ("SGLANG_OPT_DSV41_DSPARK_POST_FOLD", "0", "an in-graph verify epilogue accepts a chain"),
    ("SGLANG_OPT_DSV41_SAMPLING_ACCEPT_GRAPH", "0", "the sampling-accept graph accepts a chain"),
    ("SGLANG_OPT_DSV41_BLOCKWISE_REJECTION", "0", "block-wise rejection verifies chains"),
    ("SGLANG_SIMULATE_ACC_LEN", "-1", "simulated acceptance lengths are chain columns"),
    ("--speculative-use-rejection-sampling", "off", "its sampler is SGLang's chain sampler"),
    ("--speculative-use-block-verification", "off", "block verification accepts a chain"),
)


def model_type_check(s) -> tuple:
    return (s.model_type in DSPARK_MODEL_TYPES,
            f"the target's model_type must be one of {DSPARK_MODEL_TYPES}, got {s.model_type!r} (DeepSeek-V4.1's "
            f"layer loop and its DSpark serving extras, engram and the static verify epilogue, are not covered)")


def dspark_checks(s) -> tuple:
    """(ok, message) of every DSpark-tree setting but the model type; `s` a validate.TreeServeSettings."""
    pool = candidate_pool_size(s.topk, max(s.gamma, 1))
    return (
        (s.gamma >= 1, f"the DSpark block size (gamma) must be resolved (checkpoint dspark_block_size or "
                       f"--speculative-dspark-block-size), got {s.gamma}"),
        (s.num_steps == 1, f"--speculative-num-steps must resolve to 1 for DSPARK (the tree's depth is the "
                           f"block size, gamma = {s.gamma}), got {s.num_steps}"),
        (s.num_draft_tokens >= s.gamma,
         f"--speculative-num-draft-tokens must be >= the DSpark block size {s.gamma} (the draft block writes its "
         f"{s.gamma} rows into the verify window's first slots), got {s.num_draft_tokens}"),
        (s.num_draft_tokens - 1 <= pool,
         f"--speculative-num-draft-tokens {s.num_draft_tokens} needs {s.num_draft_tokens - 1} draft candidates, "
         f"more than a DSpark tree of topk {s.topk} and depth gamma {s.gamma} offers (topk + (gamma - 1) * topk^2 "
         f"= {pool}), so at most {pool + 1}"),
        (s.attn_dp_size == 1, f"DP attention is not supported with DSpark trees (attn_dp_size={s.attn_dp_size}, "
                              f"must be 1)"),
        (not s.unsupported, "these options are not supported with DSpark trees: " + "; ".join(s.unsupported)),
    )
