"""Commit of a tree verify in SGLang 0.5.23's DeepSeek-V4 pools: the accepted path becomes
committed state, bit for bit; nothing of a rejected node stays in committed state.

Accepted node a at depth d of request b (P committed) was verified at window slot
`out_cache_loc[b*N + a]` and belongs at `out_cache_loc[b*N + d]` (SGLang's own targets,
`move_accept_tokens_to_target_kvcache`). Its stored state moves there:
* slot-keyed records, in `move_kv_cache(tgt, src)` (which SGLang calls with those slots): the
  SWA K=V record (both pieces, through `full_to_swa_index_mapping`) and the C4 compressor state
  rows (attention and indexer; SGLang keys them by SWA slot);
* request-keyed state and entries, in the AROUND hook on `_finalize_accept_tree_path`: the C128
  state row (`req*ring + (P+a) % ring` -> `(P+d) % ring`), and the entry of every block a closed
  (C4 and C128 K=V entries, C4 indexer keys) from the slot verify wrote it to (home for the first
  node at its depth, else scratch) to its home `out_cache_loc[b*N + d] // m`. Then the C128 rows
  of positions past the new length are cleared (kv 0, score -inf), as SGLang keeps them.
All of it runs inside one `UndoLog` (`pool.dsv4_tree_commit_log` while the hook runs): any
exception restores every byte written and propagates; the pools are then as before the commit."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ConfigError, StateError
from .pool_bytes import StateRows, UndoLog, move_records
from .scratch import RATIOS, pool_layers
from .tables import first_at_depth, parents_from_retrieve, depths

LOG_ATTR = "dsv4_tree_commit_log"


@dataclass(frozen=True)
class TreeCommitPlan:
    """Moves of one commit, for all requests at once."""
    entry_src: dict  # ratio -> [K] entry slots verify wrote the accepted blocks' entries to
    entry_dst: dict  # ratio -> [K] their committed homes
    c128_src: torch.Tensor  # [M] C128 state rows (request rings) of accepted nodes
    c128_dst: torch.Tensor  # [M]
    c128_clear: torch.Tensor  # [R] C128 state rows of positions P + L .. P + N - 1


def plan_tree_commit(*, req_pool_indices, seq_lens, retrieve_next_token, retrieve_next_sibling, out_cache_loc,
                     accept_index, accept_lens, scratch, c128_ring: int | None) -> TreeCommitPlan:
    """accept_index [bs, S] global node ids root first (-1 padded), accept_lens [bs] (path
    lengths, root included), seq_lens [bs] = P; scratch: the pool's TreeScratch."""
    parents = parents_from_retrieve(retrieve_next_token, retrieve_next_sibling)
    depth = depths(parents)
    bs, n = depth.shape
    dev = depth.device
    S = accept_index.shape[1]
    L = accept_lens.to(torch.int64).view(bs, 1)
    d = torch.arange(S, device=dev).view(1, S)
    valid = d < L  # [bs, S]
    b = torch.arange(bs, device=dev).view(bs, 1).expand(bs, S)
    node = (accept_index.to(torch.int64) - b * n).clamp(0, n - 1)  # local ids
    bad = valid & ((accept_index < 0) | (depth.gather(1, node) != d))
    if bool(bad.any()):
        raise StateError("dsv4_tree commit: accept_index is not a root-first path of the verified tree "
                         f"(accept_index {accept_index.tolist()}, accept_lens {accept_lens.tolist()})")
    P = seq_lens.to(torch.int64).view(bs, 1)
    req = req_pool_indices.to(torch.int64).view(bs, 1).expand(bs, S)
    window = out_cache_loc.to(torch.int64).view(bs, n)
    first = first_at_depth(depth).gather(1, node)
    entry_src, entry_dst = {}, {}
    for m in RATIOS:
        home = window.gather(1, d.expand(bs, S).clamp(max=n - 1)) // m
        wrote = torch.where(first, home, scratch.start[m] + req * scratch.per_request + node)
        move = valid & ((P + d + 1) % m == 0) & (wrote != home)
        entry_src[m], entry_dst[m] = wrote[move], home[move]
    empty = torch.zeros(0, dtype=torch.int64, device=dev)
    if c128_ring is None:
        return TreeCommitPlan(entry_src, entry_dst, empty, empty, empty)
    moved = valid & (node != d)
    c128_src = (req * c128_ring + (P + node) % c128_ring)[moved]
    c128_dst = (req * c128_ring + (P + d) % c128_ring)[moved]
    j = torch.arange(n, device=dev).view(1, n)
    rejected = j >= L
    req_n = req_pool_indices.to(torch.int64).view(bs, 1).expand(bs, n)
    c128_clear = (req_n * c128_ring + (P + j) % c128_ring)[rejected]
    return TreeCommitPlan(entry_src, entry_dst, c128_src, c128_dst, c128_clear)


def c128_ring_size(pool) -> int | None:
    rings = {p.ring_size for p in pool.compress_state_pools if p is not None and p.ratio == 128}
    if len(rings) > 1:
        raise StateError(f"dsv4_tree commit: C128 state pools with different ring sizes {sorted(rings)}")
    return rings.pop() if rings else None


def apply_tree_commit(log: UndoLog, pool, plan: TreeCommitPlan) -> None:
    """Entry and C128 state moves of `plan` into every layer, then the C128 cleanup."""
    for lb in pool_layers(pool):
        if lb.ratio in RATIOS:
            src, dst = plan.entry_src[lb.ratio], plan.entry_dst[lb.ratio]
            for target in (lb.entries, lb.index_keys):
                if target is not None:
                    move_records(log, target, src, dst)
        if lb.ratio == 128:
            for rows in lb.state_rows():
                move_records(log, rows, plan.c128_src, plan.c128_dst)
                clear_state_rows(log, rows, plan.c128_clear)


def clear_state_rows(log: UndoLog, rows: StateRows, which: torch.Tensor) -> None:
    """kv half 0, score half -inf (SGLang's empty state row)."""
    if which.numel() == 0:
        return
    half = rows.buffer.shape[1] // 2
    empty = torch.cat([rows.buffer.new_zeros(half), rows.buffer.new_full((half,), float("-inf"))])
    log.write(rows.flat(), rows.element_index(which), empty.expand(which.numel(), -1))


def check_move_allowed(pool) -> None:
    """ConfigError unless `move_kv_cache` moves everything a slot owns on this pool (see there)."""
    if getattr(pool, "dsv4_tree_scratch", None) is None:
        raise ConfigError("dsv4_tree move_kv_cache: this DeepSeekV4TokenToKVPool was not prepared by the tree "
                          "backend (no dsv4_tree_scratch; SGLang 0.5.23's pool has no move_kv_cache): only EAGLE "
                          "topk > 1 tree verify moves DeepSeek-V4 KV slots")
    if getattr(pool, LOG_ATTR, None) is None:
        ratios = sorted({lb.ratio for lb in pool_layers(pool) if lb.ratio in RATIOS})
        if ratios:
            raise ConfigError(f"dsv4_tree move_kv_cache: outside the tree commit on a pool with compressed "
                              f"layers (ratios {ratios}): it would move SWA records and C4 state rows but not "
                              f"the entries and C128 state rows (only _finalize_accept_tree_path's commit does)")


def move_kv_cache(pool, tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
    """`DeepSeekV4TokenToKVPool.move_kv_cache` (SGLang 0.5.23 has none; `register()` sets it):
    copy the slot-keyed records of full slots src_loc [n] over tgt_loc [n]: SWA K=V records and
    C4 state rows. Pairs with tgt == src (SGLang's zero padding) are no-ops. Inside a commit the
    writes join its undo log; alone, a failure restores what this call wrote.

    Only pools the tree backend prepared (`pool.dsv4_tree_scratch`) have it: SGLang 0.5.23's other
    callers (the NGRAM worker, the pipeline-parallel relay) found none before the plug-in and get a
    ConfigError instead of a partial move. Outside the tree commit it runs only on a pool without
    C4 / C128 layers (the draft pool, for `duplicate_prefix_tail_to_draft_branches`): elsewhere
    the entries and C128 state rows, which only the commit moves, would stay behind."""
    check_move_allowed(pool)
    tgt, src = tgt_loc.to(torch.int64).view(-1), src_loc.to(torch.int64).view(-1)
    keep = tgt != src
    tgt, src = tgt[keep], src[keep]
    if tgt.numel() == 0:
        return
    limit = int(pool.full_to_swa_index_mapping.shape[0])
    if bool(((tgt < 0) | (tgt >= limit) | (src < 0) | (src >= limit)).any()):
        raise StateError(f"dsv4_tree move_kv_cache: full slots outside [0, {limit}): tgt {tgt.tolist()} "
                         f"src {src.tolist()}")
    swa_t, swa_s = pool.translate_loc_from_full_to_swa(tgt), pool.translate_loc_from_full_to_swa(src)
    if bool(((swa_t < 0) | (swa_s < 0)).any()):
        raise StateError(f"dsv4_tree move_kv_cache: full slots without an SWA slot: tgt {tgt.tolist()} "
                         f"src {src.tolist()}")
    log = getattr(pool, LOG_ATTR, None)
    own = log is None
    log = UndoLog() if own else log
    try:
        for lb in pool_layers(pool):
            move_records(log, lb.swa, swa_s, swa_t)
            if lb.ratio == 4:
                for sp in (lb.state, lb.index_state):
                    if sp is not None:
                        move_records(log, StateRows(sp.kv_score_buffer.kv_score),
                                     sp.translate_from_swa_loc_to_state_loc(swa_s.clone()),
                                     sp.translate_from_swa_loc_to_state_loc(swa_t.clone()))
    except BaseException:
        if own:
            log.rollback()
        raise


def run_tree_commit(pool, plan: TreeCommitPlan, slot_moves):
    """Apply `plan` and call `slot_moves()` (SGLang's `_finalize_accept_tree_path`, which calls
    `move_kv_cache`) as one transaction; returns slot_moves' result."""
    if getattr(pool, LOG_ATTR, None) is not None:
        raise StateError("dsv4_tree commit: a commit is already running on this pool")
    log = UndoLog()
    setattr(pool, LOG_ATTR, log)
    try:
        apply_tree_commit(log, pool, plan)
        return slot_moves()
    except BaseException:
        log.rollback()
        raise
    finally:
        setattr(pool, LOG_ATTR, None)
