"""The C4 compressor-state ring of a tree verify window in SGLang 0.5.23's DeepSeek-V4 pools, and
the largest verify window (`--speculative-num-draft-tokens`, N) the tree path serves.

SGLang keeps each C4 compressor's raw rows (kv, score) in a ring of R rows per SWA page
(`CompressStatePool.translate_from_swa_loc_to_state_loc`: `swa_page * R + swa_loc % R`; SGLang's
paged SWA slots keep a position's offset in its page, so the row is the position mod R), with
R = 16 under speculation (`get_compress_state_ring_size`). A verify window writes a row for each of
its N slots (positions P .. P + N - 1; in a tree the node's slot index, `compressor.node_state_rows`),
and a row written for position w is the row of w - R. The next round's compressions read committed
rows back to P - 6 (a C4 block closing at P' >= P + 1 pools positions P' - 7 ..), so N + 6 <= R:
SGLang's `get_compress_state_write_pad(4, R) = R - 8 + 2` (its `mtp_pad` in `c_plan.cuh`), 10 for
R = 16, which its pool configurator asserts (`_assert_ring_serves_draft_tokens`).

For a tree window wider than that, `around_resolve_compress_state_ring_size` (an AROUND hook on
SGLang's `resolve_compress_state_ring_size`, which both the configurator's budget and the pool's
`get_ring_size` call) gives C4 the smallest power of two R >= SGLang's ring whose write pad holds N:
32 for N <= 26, 64 for N <= 58. R must divide the SWA page (`c_plan.cuh`: `swa_page_size % ring_size
== 0`), 256 for DeepSeek-V4. Every reader and writer of the ring takes R from the pool or from that
function (design_notes/sglang-write-side.md, "The C4 state ring"); SGLang's chains (topk 1) and tree
windows of N <= 10 keep SGLang's ring. C128's request ring (256, write pad 130) is left as it is."""
from __future__ import annotations

from ..errors import ConfigError

SWA_PAGE = 256  # DeepSeek-V4's page (SGLang forces page_size 256); the C4 ring must divide it
SCRATCH_INDEX_PAGE = 64  # C4 index-pool page: one request's scratch slots must fit two (branch_candidates)


def _sglang_ring_functions():
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import (get_compress_state_ring_size,
                                                              get_compress_state_write_pad)

    return get_compress_state_ring_size, get_compress_state_write_pad


def tree_c4_ring_size(num_draft_tokens: int, sglang_ring: int) -> int:
    """Rows per SWA page of the C4 state ring for a tree window of num_draft_tokens rows:
    SGLang's ring while its write pad holds the window, else the smallest power-of-two multiple
    of it that does (a ConfigError past the SWA page)."""
    _, write_pad = _sglang_ring_functions()
    ring = sglang_ring
    while write_pad(4, ring) < num_draft_tokens and ring < SWA_PAGE:
        ring *= 2
    if write_pad(4, ring) < num_draft_tokens or SWA_PAGE % ring:
        raise ConfigError(f"dsv4_tree tree verify: --speculative-num-draft-tokens {num_draft_tokens} needs a C4 "
                          f"state ring wider than the SWA page of {SWA_PAGE} rows (at most "
                          f"{write_pad(4, SWA_PAGE)} draft tokens)")
    return ring


def tree_draft_token_capacity() -> int:
    """Largest N the tree path serves: the C4 ring grown to the SWA page (write pad 250), SGLang's
    C128 request ring (256 rows, write pad 130, not grown) and one request's scratch slots within
    two C4 index pages (`branch_candidates.scratch_index_pages`: N <= 64). Hence 64."""
    ring_size, write_pad = _sglang_ring_functions()
    return min(write_pad(4, SWA_PAGE), write_pad(128, ring_size(128, 1)), SCRATCH_INDEX_PAGE)


def _tree_window():
    """The published spec's N when it is a tree (topk > 1), else None."""
    from sglang.srt.runtime_context import get_spec

    spec = get_spec()
    if spec.speculative_algorithm is None or int(spec.speculative_eagle_topk or 0) <= 1:
        return None
    return int(spec.speculative_num_draft_tokens or 0)


def around_resolve_compress_state_ring_size(original, compress_ratio):
    ring = original(compress_ratio)
    n = _tree_window() if compress_ratio == 4 else None
    if n is None:
        return ring  # chains (topk 1), no speculation, other ratios: SGLang's ring
    return tree_c4_ring_size(n, ring)


def check_pool_rings(pool, num_draft_tokens: int) -> None:
    """ConfigError unless every C4 / C128 state ring of the pool serves a window of num_draft_tokens
    rows (write pad >= N) and every C4 ring divides its SWA page: a pool built without the ring
    hook (or by another sizing) would let a verify overwrite committed rows."""
    _, write_pad = _sglang_ring_functions()
    for sp in list(pool.compress_state_pools) + list(pool.indexer_compress_state_pools):
        if sp is None or sp.ratio not in (4, 128):
            continue
        if write_pad(sp.ratio, sp.ring_size) < num_draft_tokens:
            raise ConfigError(f"dsv4_tree tree verify: the pool's C{sp.ratio} state ring of {sp.ring_size} rows "
                              f"serves at most {write_pad(sp.ratio, sp.ring_size)} draft tokens, "
                              f"--speculative-num-draft-tokens is {num_draft_tokens} (the ring must be sized by "
                              f"SGLang's resolve_compress_state_ring_size with the plug-in's hook applied)")
        if sp.ratio == 4 and sp.swa_page_size % sp.ring_size:
            raise ConfigError(f"dsv4_tree tree verify: the C4 state ring of {sp.ring_size} rows does not divide "
                              f"the SWA page of {sp.swa_page_size}")
