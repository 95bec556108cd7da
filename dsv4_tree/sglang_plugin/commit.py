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
PENDING_ATTR = "dsv4_tree_commit_pending"  # SGLang's C128 cleanup was skipped; the tree commit must follow


def defer_c128_cleanup(pool) -> None:
    """SGLang's `clear_unaccepted_c128_draft_states` on a tree pool: skipped (it clears C128 ring
    rows by node number, wiping accepted nodes' rows before they move) because the tree commit,
    which SGLang runs next in the same verify (`_finalize_accept_tree_path`), clears the rejected
    rows itself. The skip is recorded on the pool and the commit consumes it; a second cleanup, or
    a tree verify, while one is recorded means the commit never ran (a verify path without
    `finalize_tree_path`): StateError, before anything is written, rather than a pool whose
    accepted path was never moved and whose rejected C128 rows were never cleared."""
    check_no_pending_commit(pool, "SGLang's C128 cleanup (clear_unaccepted_c128_draft_states)")
    setattr(pool, PENDING_ATTR, True)


def take_deferred_cleanup(pool) -> None:
    """The tree commit (the `_finalize_accept_tree_path` hook, on entry) takes over the recorded skip."""
    setattr(pool, PENDING_ATTR, False)


def check_no_pending_commit(pool, what: str) -> None:
    if getattr(pool, PENDING_ATTR, False):
        raise StateError(f"dsv4_tree: {what} with the previous verify's tree commit still pending: SGLang's C128 "
                         f"cleanup was skipped for it and _finalize_accept_tree_path never ran (a verify path "
                         f"with finalize_tree_path=False, e.g. --enable-multi-layer-eagle, is not supported)")


@dataclass(frozen=True)
class TreeCommitPlan:
    """Moves of one commit, for all requests at once, fixed-shape (no host read to build it):
    pairs that move nothing are src == dst no-ops on slots no real pair writes."""
    entry_src: dict  # ratio -> [bs * S] entry slots verify wrote the accepted blocks' entries to
    entry_dst: dict  # ratio -> [bs * S] their committed homes
    c128_src: torch.Tensor  # [bs * S] C128 state rows (request rings) of accepted nodes
    c128_dst: torch.Tensor  # [bs * S]
    c128_rows: torch.Tensor  # [bs * N] C128 state rows of positions P .. P + N - 1
    c128_clear: torch.Tensor  # [bs * N] bool: cleared (positions P + L .. P + N - 1)


def check_accept_path(accept_index, accept_lens, parents, depth, window=None, full_to_swa=None) -> torch.Tensor:
    """StateError (naming the field and the bound) unless, for every request b, accept_lens[b] is
    in [1, S] and the first accept_lens[b] entries of accept_index[b] are b's own node ids
    (b*N .. b*N + N - 1, N the window) forming a root-first path: entry d at depth d, its parent
    entry d - 1; and (window [bs, N], full_to_swa given) every window slot is a full slot with an
    SWA slot, which lets `move_kv_cache` run inside the commit without a read of its own. One
    host read for all checks. -> local node ids [bs, S] (padding entries: 0)."""
    bs, n = depth.shape
    S = accept_index.shape[1]
    dev = depth.device
    L = accept_lens.to(torch.int64).view(bs, 1)
    d = torch.arange(S, device=dev).view(1, S)
    valid = d < L
    local = accept_index.to(torch.int64) - torch.arange(bs, device=dev).view(bs, 1) * n
    in_window = (local >= 0) & (local < n)
    node = torch.where(valid & in_window, local, torch.zeros_like(local))
    prev = torch.cat([torch.full_like(node[:, :1], -1), node[:, :-1]], dim=1)
    checks = [
        ((L < 1) | (L > S)).any(),
        (valid & ~in_window).any(),
        (valid & (depth.gather(1, node) != d)).any(),
        (valid & (d >= 1) & (parents.gather(1, node) != prev)).any(),
    ]
    if window is not None:
        limit = full_to_swa.shape[0]
        inside = (window >= 0) & (window < limit)
        checks.append((~inside | (full_to_swa[window.clamp(0, limit - 1)] < 0)).any())
    failed = torch.stack(checks).tolist()  # the commit's one host read
    if any(failed):
        what = (f"accept_lens must be in [1, {S}] (accept_index's width)",
                f"accept_index[b, :accept_lens[b]] must be request b's own node ids b*{n} .. b*{n}+{n - 1}",
                "accept_index[b, d] must be a node at depth d",
                "accept_index[b, d]'s parent must be accept_index[b, d-1]",
                "out_cache_loc must name full slots in [0, full_to_swa_index_mapping's size) with an SWA slot "
                f"(out_cache_loc {None if window is None else window.tolist()})")[failed.index(True)]
        raise StateError(f"dsv4_tree commit: accept_index is not a root-first path of the verified tree: {what} "
                         f"(accept_index {accept_index.tolist()}, accept_lens {accept_lens.tolist()})"
                         if failed.index(True) < 4 else f"dsv4_tree commit: {what}")
    return node


def plan_tree_commit(*, req_pool_indices, seq_lens, retrieve_next_token, retrieve_next_sibling, out_cache_loc,
                     accept_index, accept_lens, scratch, c128_ring: int | None,
                     full_to_swa: torch.Tensor | None = None) -> TreeCommitPlan:
    """accept_index [bs, S] global node ids root first (-1 padded), accept_lens [bs] (path
    lengths, root included), seq_lens [bs] = P; scratch: the pool's TreeScratch; full_to_swa:
    the pool's mapping (the window's slots are checked against it). Checked (`check_accept_path`)
    before anything is planned, so before any write."""
    parents = parents_from_retrieve(retrieve_next_token, retrieve_next_sibling)
    depth = depths(parents)
    bs, n = depth.shape
    window_slots = out_cache_loc.to(torch.int64).view(bs, n) if full_to_swa is not None else None
    node = check_accept_path(accept_index, accept_lens, parents, depth, window_slots, full_to_swa)
    dev = depth.device
    S = accept_index.shape[1]
    L = accept_lens.to(torch.int64).view(bs, 1)
    d = torch.arange(S, device=dev).view(1, S)
    valid = d < L  # [bs, S]
    P = seq_lens.to(torch.int64).view(bs, 1)
    req = req_pool_indices.to(torch.int64).view(bs, 1).expand(bs, S)
    window = out_cache_loc.to(torch.int64).view(bs, n)
    first = first_at_depth(depth).gather(1, node)
    entry_src, entry_dst = {}, {}
    for m in RATIOS:
        home = window.gather(1, d.expand(bs, S).clamp(max=n - 1)) // m
        own_scratch = scratch.start[m] + req * scratch.per_request + node
        wrote = torch.where(first, home, own_scratch)
        move = valid & ((P + d + 1) % m == 0) & (wrote != home)
        # no-op pairs on the node's own scratch slot: no real pair writes scratch (homes lie below it)
        entry_src[m] = torch.where(move, wrote, own_scratch).view(-1)
        entry_dst[m] = torch.where(move, home, own_scratch).view(-1)
    if c128_ring is None:
        empty = torch.zeros(0, dtype=torch.int64, device=dev)
        return TreeCommitPlan(entry_src, entry_dst, empty, empty, empty, empty.bool())
    moved = valid & (node != d)
    # a pair that moves nothing rewrites its own depth's row, which no real pair targets (each
    # real pair targets its own depth d, d < S <= N <= ring)
    dst = req * c128_ring + (P + d) % c128_ring
    c128_src = torch.where(moved, req * c128_ring + (P + node) % c128_ring, dst).view(-1)
    j = torch.arange(n, device=dev).view(1, n)
    req_n = req_pool_indices.to(torch.int64).view(bs, 1)
    c128_rows = (req_n * c128_ring + (P + j) % c128_ring).view(-1)
    return TreeCommitPlan(entry_src, entry_dst, c128_src, dst.reshape(-1), c128_rows, (j >= L).view(-1))


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
                clear_state_rows(log, rows, plan.c128_rows, plan.c128_clear)


def clear_state_rows(log: UndoLog, rows: StateRows, which: torch.Tensor, clear: torch.Tensor) -> None:
    """Rows `which` [R] where `clear` [R]: kv half 0, score half -inf (SGLang's empty state row);
    the others keep their values (rewritten with themselves: fixed shape, no host read)."""
    if which.numel() == 0:
        return
    half = rows.buffer.shape[1] // 2
    empty = torch.cat([rows.buffer.new_zeros(half), rows.buffer.new_full((half,), float("-inf"))])
    index = rows.element_index(which)
    log.write(rows.flat(), index, torch.where(clear.view(-1, 1), empty.view(1, -1), rows.flat()[index]))


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
    writes join its undo log and the call reads nothing on the host (`commit_swa_pairs`); alone, a
    failure restores what this call wrote.

    Only pools the tree backend prepared (`pool.dsv4_tree_scratch`) have it: SGLang 0.5.23's other
    callers (the NGRAM worker, the pipeline-parallel relay) found none before the plug-in and get a
    ConfigError instead of a partial move. Outside the tree commit it runs only on a pool without
    C4 / C128 layers (the draft pool, for `duplicate_prefix_tail_to_draft_branches`): elsewhere
    the entries and C128 state rows, which only the commit moves, would stay behind."""
    check_move_allowed(pool)
    tgt, src = tgt_loc.to(torch.int64).view(-1), src_loc.to(torch.int64).view(-1)
    log = getattr(pool, LOG_ATTR, None)
    if log is not None:  # inside the commit: fixed shape, no host read (the hook checked the window's slots)
        swa_s, swa_t = commit_swa_pairs(pool, tgt, src)
        return _move_slot_records(pool, log, swa_s, swa_t)
    # Outside the commit (the draft pool's duplicate_prefix_tail_to_draft_branches, run eagerly by
    # prepare_for_draft before the draft graph): one host read per call drops SGLang's tgt == src
    # padding pairs (slot 0, which may have no SWA slot) and checks every slot.
    keep = tgt != src
    tgt, src = tgt[keep], src[keep]
    if tgt.numel() == 0:
        return
    limit = int(pool.full_to_swa_index_mapping.shape[0])
    outside = (tgt < 0) | (tgt >= limit) | (src < 0) | (src >= limit)
    swa_t = pool.translate_loc_from_full_to_swa(tgt.clamp(0, limit - 1))
    swa_s = pool.translate_loc_from_full_to_swa(src.clamp(0, limit - 1))
    bad_range, bad_swa = torch.stack([outside.any(), ((swa_t < 0) | (swa_s < 0)).any()]).tolist()
    if bad_range:
        raise StateError(f"dsv4_tree move_kv_cache: full slots outside [0, {limit}): tgt {tgt.tolist()} "
                         f"src {src.tolist()}")
    if bad_swa:
        raise StateError(f"dsv4_tree move_kv_cache: full slots without an SWA slot: tgt {tgt.tolist()} "
                         f"src {src.tolist()}")
    log = UndoLog()
    try:
        _move_slot_records(pool, log, swa_s, swa_t)
    except BaseException:
        log.rollback()
        raise


def commit_swa_pairs(pool, tgt: torch.Tensor, src: torch.Tensor) -> tuple:
    """SGLang's commit moves tgt <- src [n] (full slots) -> SWA slots (src, dst) [n], fixed shape, no
    host read: every pair that moves nothing (tgt == src: SGLang's zero padding, a root at its own
    slot) becomes a copy of one chosen pair, a real move when there is one (so it writes that
    pair's value to that pair's slot again), else a self-move of a slot with an SWA slot."""
    limit = pool.full_to_swa_index_mapping.shape[0]
    swa_t = pool.translate_loc_from_full_to_swa(tgt.clamp(0, limit - 1)).to(torch.int64)
    swa_s = pool.translate_loc_from_full_to_swa(src.clamp(0, limit - 1)).to(torch.int64)
    real = tgt != src
    rank = real.to(torch.int8) * 2 + ((swa_t >= 0) & (swa_s >= 0)).to(torch.int8)
    pick = rank.argmax().view(1)
    return torch.where(real, swa_s, swa_s[pick]), torch.where(real, swa_t, swa_t[pick])


def _move_slot_records(pool, log: UndoLog, swa_s: torch.Tensor, swa_t: torch.Tensor) -> None:
    """SWA records and C4 state rows of SWA slots swa_s over swa_t, every layer, into `log`."""
    if swa_s.numel() == 0:
        return
    for lb in pool_layers(pool):
        move_records(log, lb.swa, swa_s, swa_t)
        if lb.ratio == 4:
            for sp in (lb.state, lb.index_state):
                if sp is not None:
                    move_records(log, StateRows(sp.kv_score_buffer.kv_score),
                                 sp.translate_from_swa_loc_to_state_loc(swa_s.clone()),
                                 sp.translate_from_swa_loc_to_state_loc(swa_t.clone()))


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
