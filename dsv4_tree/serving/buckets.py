"""Static-shape buckets: pad a verify plan so one captured forward serves every batch that fits.

A bucket fixes the row count T (requests rounded up to a power of two, times num_draft_tokens),
the closing rows E per ratio (at most T) and the width C of each ratio's entry table (rounded
up to a power of two, at least 64). Padded rows read nothing (empty index lists), write their
K=V / compressor rows to the trash recent slot and their entries to the trash entry slot, so
they can never change a real row or reach committed state; their logits are dropped."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .pools import Layout
from .tables import CompressTables, VerifyPlan


@dataclass(frozen=True)
class Bucket:
    rows: int  # T after padding
    closing: tuple  # ((ratio, E after padding), ...)
    widths: tuple  # ((ratio, C after padding), ...)


def _pow2(n: int, floor: int = 1) -> int:
    p = floor
    while p < n:
        p *= 2
    return p


def bucket_for(plan: VerifyPlan, max_nodes: int) -> Bucket:
    t = _pow2(len(plan.num_nodes)) * max_nodes
    return Bucket(t, tuple((m, t) for m in sorted(plan.compress)),
                  tuple((m, _pow2(ct.entries.shape[1], 64)) for m, ct in sorted(plan.compress.items())))


def _pad_rows(x: torch.Tensor, n: int, value: int) -> torch.Tensor:
    if x.shape[0] >= n:
        return x
    return torch.cat([x, torch.full((n - x.shape[0], *x.shape[1:]), value, dtype=x.dtype, device=x.device)])


def _pad_cols(x: torch.Tensor, n: int, value: int) -> torch.Tensor:
    if x.shape[1] >= n:
        return x
    return torch.cat([x, torch.full((x.shape[0], n - x.shape[1]), value, dtype=x.dtype, device=x.device)], 1)


def pad_plan(plan: VerifyPlan, bucket: Bucket, layout: Layout) -> VerifyPlan:
    """The plan with T, E and C padded to `bucket` (real rows first, unchanged)."""
    t = bucket.rows
    if plan.num_rows > t:
        raise ValueError(f"plan has {plan.num_rows} rows, bucket holds {t}")
    trash = layout.trash_recent_slot
    closing, widths = dict(bucket.closing), dict(bucket.widths)
    compress = {}
    for m, ct in plan.compress.items():
        e = closing[m]
        entries = _pad_cols(_pad_rows(ct.entries, t, -1), widths[m], -1)
        compress[m] = CompressTables(
            m,
            _pad_rows(ct.closing, e, t - 1),
            _pad_rows(ct.entry_out, e, layout.trash_entry_slot(m)),
            _pad_rows(ct.block_start, e, 0),
            _pad_rows(ct.src, e, trash),
            entries,
            _pad_rows(ct.entry_len, t, 0),
        )
    return replace(
        plan,
        num_rows=t,
        input_ids=_pad_rows(plan.input_ids, t, 0),
        positions=_pad_rows(plan.positions, t, 0),
        out_loc=_pad_rows(plan.out_loc, t, trash),
        swa_index=_pad_rows(plan.swa_index, t, -1),
        swa_len=_pad_rows(plan.swa_len, t, 0),
        compress=compress,
    )
