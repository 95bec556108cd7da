"""Worker-side settings of a DSpark tree: where SGLang 0.5.23 sizes things by
`speculative_num_draft_tokens == gamma + 1` or by topk, the DSpark tree's gamma (draft block rows,
`speculative_dspark_block_size`, declared by `dspark_args.around_handle_dspark`) and N (verify rows,
`speculative_num_draft_tokens`) are kept apart:

* the worker's runtime config (`resolve_runtime_config`): gamma from the block size, the verify
  window N;
* the draft runner's graph buckets and backend: its captured width is the draft block (gamma rows
  per request, `get_num_tokens_per_req_for_target_verify`), and its DeepSeek-V4 backend is built
  as SGLang builds it for a DSpark chain of that gamma (topk 1, N = gamma + 1: `draft_spec_view`);
* the target's verify buckets stay N rows per request (SGLang's own sizing);
* the per-decode KV allocation (`get_alloc_len_per_decode`): N slots per request, as for a DSpark
  chain, not EAGLE's per-branch page regions (a DSpark tree has no draft branches in the KV).

Each hook acts only when the published spec is a DSpark tree (DSPARK with topk > 1, which only the
plug-in's argument hook lets through); otherwise SGLang's function runs alone."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import StateError


@dataclass(frozen=True)
class DSparkTreeSpec:
    topk: int  # children per frontier node, frontier width
    gamma: int  # draft block rows: the tree's depth
    num_draft_tokens: int  # N: verify rows per request (the root included)


def dspark_tree_spec():
    """The published DSpark tree's (topk, gamma, N), or None for anything else (also where no
    spec is published: a process that has not resolved a launch serves no tree)."""
    from sglang.srt.runtime_context import get_spec

    try:
        spec = get_spec()
    except ValueError:  # SGLang's "config namespace 'spec' not published"
        return None
    if str(spec.speculative_algorithm) != "DSPARK" or int(spec.speculative_eagle_topk or 0) <= 1:
        return None
    gamma = int(spec.speculative_dspark_block_size or 0)
    if gamma < 1:
        raise StateError("dsv4_tree DSPARK tree: the published spec has topk "
                         f"{spec.speculative_eagle_topk} but no speculative_dspark_block_size (the plug-in's "
                         "argument hook declares it; was the plug-in loaded in the launching process?)")
    return DSparkTreeSpec(int(spec.speculative_eagle_topk), gamma, int(spec.speculative_num_draft_tokens))


def around_resolve_runtime_config(original, *, draft_hf_config, speculative_num_draft_tokens, target_vocab_size):
    tree = dspark_tree_spec()
    if tree is None:
        return original(draft_hf_config=draft_hf_config, speculative_num_draft_tokens=speculative_num_draft_tokens,
                        target_vocab_size=target_vocab_size)
    from sglang.srt.speculative.dspark_components.dspark_config import DSparkRuntimeConfig

    # SGLang's resolution and checks for the chain of this gamma, then the tree's verify width
    chain = original(draft_hf_config=draft_hf_config, speculative_num_draft_tokens=tree.gamma + 1,
                     target_vocab_size=target_vocab_size)
    return DSparkRuntimeConfig(gamma=chain.gamma, verify_num_draft_tokens=tree.num_draft_tokens,
                               mask_token_id=chain.mask_token_id)


def around_num_tokens_per_req_for_target_verify(original, algorithm, num_draft_tokens, is_draft_worker):
    if is_draft_worker and algorithm.is_dspark():
        tree = dspark_tree_spec()
        if tree is not None:
            return tree.gamma  # the draft block (sample_from_anchor: gamma query rows; the worker checks it)
    return original(algorithm, num_draft_tokens, is_draft_worker)


def around_get_alloc_len_per_decode(original):
    tree = dspark_tree_spec()
    if tree is None:
        return original()
    from sglang.srt.runtime_context import get_spec, max_speculative_num_draft_tokens

    # SGLang's topk-1 rule: the verify window (the draft block writes into its first gamma slots)
    return max(int(get_spec().speculative_num_steps or 1), int(max_speculative_num_draft_tokens()))


def draft_spec_overrides() -> dict:
    """How the DSpark draft runner's backend must see the spec: SGLang's DSpark chain of gamma."""
    tree = dspark_tree_spec()
    return {"speculative_eagle_topk": 1, "speculative_num_draft_tokens": tree.gamma + 1}
