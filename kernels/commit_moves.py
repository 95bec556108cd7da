"""Commit's slot moves for every pool of every layer in one launch.

    move_records(segments, src, dst, bounds)

A pool is one or two byte segments (serving/commit.py: pool_segments): an FP8 pool's data
records and scale records, a plain pool's rows, a compressor's kv and gate rows. Segment i is a
row of `segments` [num_segments, 6] int64:

    base address, move group, page_size, page_bytes, first byte offset, width in bytes

and slot s of it lives at base + (s // page_size) * page_bytes + offset + (s % page_size) * width.
A move group is one list of slot moves (0: the recent slots of the accepted rows, raw rows and
compressor rows together; 1 + i: the entries of the i-th ratio). Group g's moves of request r are
src / dst [bounds[g, r] : bounds[g, r + 1]], in the request's depth order.

One program per (segment, request, byte block) applies that request's moves in list order.
Recent move d of a request copies position P + node_d to P + d, where node_d > d (a tree's
parents precede their children): move d reads above every earlier move's write, so no move
reads a slot an earlier one wrote, and the slot P + d it writes is read only by a move of
smaller depth, which came first. In-order
copies are therefore the torch path's gather-first result (serving/commit.py: apply_moves, the
reference) without a staging buffer. Entry moves go from scratch slots to committed slots
(disjoint ranges). Distinct requests and distinct segments share no byte. Bytes are copied as
they are (bitwise)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4_tree.errors import InputError

from ._launch import check, check_device

SEGMENT_FIELDS = 6
BLOCK = 512


@triton.jit
def _move_kernel(seg_ptr, src_ptr, dst_ptr, bounds_ptr, R, BLOCK: tl.constexpr):
    seg = tl.program_id(0)
    r = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    d = seg_ptr + seg * 6
    base = tl.load(d).to(tl.pointer_type(tl.uint8))
    g = tl.load(d + 1)
    ps = tl.load(d + 2)
    pb = tl.load(d + 3)
    off = tl.load(d + 4)
    w = tl.load(d + 5)
    live = cols < w
    lo = tl.load(bounds_ptr + g * (R + 1) + r)
    hi = tl.load(bounds_ptr + g * (R + 1) + r + 1)
    for k in range(lo, hi):
        s = tl.load(src_ptr + k)
        t = tl.load(dst_ptr + k)
        v = tl.load(base + (s // ps) * pb + off + (s % ps) * w + cols, mask=live)
        tl.store(base + (t // ps) * pb + off + (t % ps) * w + cols, v, mask=live)


def move_records(segments: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, bounds: torch.Tensor,
                 max_width: int) -> None:
    """segments int64 [num_segments, 6] (above); src, dst int64 [M]; bounds int64 [G, R + 1]
    (group g's moves of request r: [bounds[g, r], bounds[g, r + 1])); max_width: the widest
    segment in bytes (a host int). Every segment's group must be < G."""
    check_device(segments, src, dst, bounds)
    check("segments", segments, 2, (torch.int64,))
    check("src", src, 1, (torch.int64,))
    check("dst", dst, 1, (torch.int64,))
    check("bounds", bounds, 2, (torch.int64,))
    if segments.shape[1] != SEGMENT_FIELDS:
        raise InputError(f"segments must be [num_segments, {SEGMENT_FIELDS}], got {tuple(segments.shape)}")
    if src.shape != dst.shape:
        raise InputError(f"src and dst must have one shape [M], got {tuple(src.shape)} {tuple(dst.shape)}")
    if bounds.shape[1] < 1:
        raise InputError(f"bounds must be [G, R + 1], got {tuple(bounds.shape)}")
    if isinstance(max_width, bool) or not isinstance(max_width, int) or max_width <= 0:
        raise InputError(f"max_width must be a positive host int, got {max_width!r}")
    if src.numel() == 0 or segments.shape[0] == 0:
        return
    requests = bounds.shape[1] - 1
    grid = (segments.shape[0], requests, triton.cdiv(max_width, BLOCK))
    _move_kernel[grid](segments, src, dst, bounds, requests, BLOCK=BLOCK)
