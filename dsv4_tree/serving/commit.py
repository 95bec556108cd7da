"""Commit by slot moves: fold accepted paths into the pools (data movement only).

Accepted node a at depth d of a request with P committed positions was verified at the slot of
position P + a (SGLang's tree convention) and belongs at the slot of position P + d. Commit
copies its stored rows (raw K=V record, compressor rows) there, and copies the branch entry it
closed (if any) from its scratch slot to the committed entry slot of its block. Nothing is
recomputed; rejected rows are simply never copied (their pages are freed by the caller)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ConfigError, InputError, StateError
from .pages import PageTable
from .pools import LayerPools, Layout


@dataclass(frozen=True)
class SlotMoves:
    """Copies of one commit, for all requests at once (host tensors until applied).

    Move group 0 is the recent slots (raw rows and compressor rows move together), group 1 + i
    the entries of the i-th ratio (ascending); within a group, request by request in the
    order given, each request's moves by depth."""

    src: torch.Tensor  # [M] int64 source slots, group after group
    dst: torch.Tensor  # [M] int64 destination slots
    bounds: torch.Tensor  # [G, R + 1] int64: group g's moves of request r are src[bounds[g, r]:bounds[g, r + 1]]
    counts: tuple  # G host ints: moves per group
    ratios: tuple  # the entry groups' ratios, ascending
    # int64 index tensors the caller needs on the device with the moves (the engine's rows of
    # the accepted nodes); they travel in the same copy
    carried: tuple = ()

    def _group(self, t: torch.Tensor, g: int) -> torch.Tensor:
        start = sum(self.counts[:g])
        return t[start:start + self.counts[g]]

    @property
    def recent_src(self) -> torch.Tensor:  # [counts[0]]
        return self._group(self.src, 0)

    @property
    def recent_dst(self) -> torch.Tensor:  # [counts[0]]
        return self._group(self.dst, 0)

    @property
    def entry_src(self) -> dict:  # ratio -> scratch entry slots
        return {m: self._group(self.src, 1 + i) for i, m in enumerate(self.ratios)}

    @property
    def entry_dst(self) -> dict:  # ratio -> committed entry slots
        return {m: self._group(self.dst, 1 + i) for i, m in enumerate(self.ratios)}

    def to(self, device) -> "SlotMoves":
        """All moves, their bounds and the carried tensors on `device` through one
        host-to-device copy of one packed buffer."""
        parts = [self.src, self.dst, self.bounds.reshape(-1)] + list(self.carried)
        flat = torch.cat(parts).to(device, non_blocking=True).split([p.numel() for p in parts])
        return SlotMoves(flat[0], flat[1], flat[2].view(self.bounds.shape), self.counts, self.ratios, tuple(flat[3:]))


@dataclass(frozen=True)
class PoolSegments:
    """Every pool of every layer as byte segments, for the Triton commit (kernels/commit_moves.py)."""

    table: torch.Tensor  # [num_segments, 6] int64 on the pools' device: base, group, page_size, page_bytes, first, width
    max_width: int  # the widest segment, bytes
    ratios: tuple  # the entry groups' ratios, ascending (SlotMoves.ratios)
    bases: tuple  # host ints: the table's base addresses (checked before each launch)


def _row_segment(rows: torch.Tensor) -> tuple:
    """A contiguous [slots, width] tensor as one segment (base, page_size 1, row bytes, 0, row bytes)."""
    if not rows.is_contiguous():
        raise ConfigError(f"compressor rows must be contiguous for the Triton commit, strides {rows.stride()}")
    width = rows.shape[1] * rows.element_size()
    return (rows.data_ptr(), 1, width, 0, width)


def _segment_rows(pools: list, ratios: tuple) -> list:
    """(move group, segment) of every pool of every layer, in a fixed order."""
    rows = []
    for lp in pools:
        lp: LayerPools
        rows += [(0, seg) for seg in lp.swa.byte_segments()]
        for comp in lp.compressors:
            rows += [(0, _row_segment(comp.rows_kv)), (0, _row_segment(comp.rows_gate))]
            rows += [(1 + ratios.index(comp.ratio), seg) for seg in comp.entries.byte_segments()]
    return rows


def pool_segments(pools: list, layout: Layout) -> PoolSegments:
    """The segment table of `pools`, built once (pools keep their storage for the runtime's life;
    apply_moves checks that they still do before each launch)."""
    ratios = tuple(sorted(layout.ratios))
    rows = _segment_rows(pools, ratios)
    table = torch.tensor([[base, g, ps, pb, first, w] for g, (base, ps, pb, first, w) in rows], dtype=torch.int64)
    device = pools[0].swa.storage.device
    return PoolSegments(table.to(device), max(r[1][4] for r in rows), ratios, tuple(r[1][0] for r in rows))


def _nodes(path) -> list:
    """A path's node ids as host ints (a tensor or a sequence of ints)."""
    return path.tolist() if isinstance(path, torch.Tensor) else list(path)


def plan_moves(pages: PageTable, layout: Layout, rows, seq_lens, paths, carry=()) -> SlotMoves:
    """rows / seq_lens / paths per request (path: accepted node ids root first, a tensor or a
    sequence of ints); carry: int64 host tensors to bring to the device with the moves.

    Which rows move and which blocks close is host arithmetic on a few ints per request; the
    slot lookups then run once for the whole batch (none when nothing moves or closes, as in
    most plain decode steps)."""
    ratios = tuple(sorted(layout.ratios))
    mv_rows, mv_src, mv_dst = [], [], []
    closed = {m: ([], [], []) for m in ratios}  # request row, node, first position of the block
    ends = [[0] for _ in range(1 + len(ratios))]  # per group: moves so far after each request
    for row, p, path in zip(rows, seq_lens, paths):
        for d, node in enumerate(_nodes(path)):
            if node != d:
                mv_rows.append(row)
                mv_src.append(p + node)
                mv_dst.append(p + d)
            for m, (c_rows, c_nodes, c_first) in closed.items():
                if (p + d + 1) % m == 0:
                    c_rows.append(row)
                    c_nodes.append(node)
                    c_first.append(p + d + 1 - m)
        ends[0].append(len(mv_rows))
        for i, m in enumerate(ratios):
            ends[1 + i].append(len(closed[m][0]))
    empty = torch.zeros(0, dtype=torch.int64)
    ints = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731

    def recent(rws, pos):
        return pages.recent_slots(pages.token_slots(ints(rws), ints(pos))) if rws else empty

    src, dst = [recent(mv_rows, mv_src)], [recent(mv_rows, mv_dst)]
    for m in ratios:
        c_rows, c_nodes, c_first = closed[m]
        src.append(layout.scratch_slot(m, ints(c_rows), ints(c_nodes)) if c_rows else empty)
        dst.append(layout.entry_slot(m, pages.token_slots(ints(c_rows), ints(c_first))) if c_rows else empty)
    counts = tuple(e[-1] for e in ends)
    starts = [sum(counts[:g]) for g in range(len(counts))]
    bounds = ints([[start + e for e in group] for start, group in zip(starts, ends)])
    return SlotMoves(torch.cat(src), torch.cat(dst), bounds, counts, ratios, tuple(carry))


@torch.inference_mode()
def apply_moves(pools: list, moves: SlotMoves, before_write=None, segments: PoolSegments | None = None,
                move_records=None) -> None:
    """Bitwise copies into every layer's pools (gather first, so overlapping moves are safe).
    before_write(): called once before the first copy. From then on the draft rows may be
    moved over (a move's destination can be another's source), so a commit that fails part-way
    cannot be retried from them: the engine marks the verify output spent there.

    segments and move_records (the Triton backend): every pool's copies in one launch of
    `move_records` (kernels/commit_moves.py) over the segment table; without, the torch copies
    below (the reference)."""
    if (segments is None) != (move_records is None):
        raise InputError("apply_moves needs segments and move_records together (the Triton commit) or neither "
                         f"(the torch commit); got segments={'set' if segments is not None else None}, "
                         f"move_records={'set' if move_records is not None else None}")
    if segments is not None and segments.ratios != moves.ratios:
        raise InputError(f"commit moves for ratios {moves.ratios}, pool segments for {segments.ratios}")
    if segments is not None and tuple(seg[0] for _, seg in _segment_rows(pools, segments.ratios)) != segments.bases:
        raise StateError("the pools' storage moved since their segment table was built (pool_segments)")
    if before_write is not None:
        before_write()
    if segments is not None:
        move_records(segments.table, moves.src, moves.dst, moves.bounds, segments.max_width)
        return
    rs, rd = moves.recent_src, moves.recent_dst
    for lp in pools:
        lp: LayerPools
        if rs.numel():
            lp.swa.copy(rs, rd)
            for comp in lp.compressors:
                comp.copy_rows(rs, rd)
        for comp in lp.compressors:
            es, ed = moves.entry_src[comp.ratio], moves.entry_dst[comp.ratio]
            if es.numel():
                comp.entries.copy(es, ed)
