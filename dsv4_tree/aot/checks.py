"""The gate's limits, applied to CompileResults, and its summary table.

    flags(result, where)      -> ["SMEM>227K", "SPILL", "TIME>120s", "NO-MMA", ...] (empty: clean)
    summary(results, wheres)  -> the per-kernel table (markdown) and the verdict line

Limits (an H200: sm_90a, 227 KB of shared memory per block, 255 registers per thread):
* SMEM>227K   static (cuobjdump SHARED, the 1 KB sm_90a reserve) + dynamic (metadata.shared, or
              the early answer when the compile stopped there) over 227 KB: the launch fails.
* SPILL       ptxas spill stores / loads, cuobjdump STACK or LOCAL > 0 (ptxas 13.4 often moves a
              working set to the stack wholesale at 32 registers, so registers alone miss it).
* TIME        a compile (Triton's stages + ptxas) over the bound: the JIT stalls a user's first step.
* NO-MMA      an attention or indexer kernel without a tensor-core instruction (HMMA / HGMMA ...)
              when it was launched in its bf16 form (constexpr MMA=True) or at a bf16 model's
              dims (any scenario but the "tiny*" ones, whose fp32 model takes the fp32 form).
* FAIL        the compile failed (error, timeout, memory, worker crash).
"""
from __future__ import annotations

from collections import defaultdict

H200_SMEM = 227 * 1024
TIME_LIMIT = 120.0  # seconds per compile, on 2 CPU cores
MMA_KERNELS = frozenset({"_sparse_decode_kernel", "_indexer_topk_kernel", "_indexer_gather_kernel"})


def smem_bytes(r) -> int:
    return int(r.get("shared", 0)) + int(r.get("static_shared", 0))


def flags(r, where: str = "", time_limit: float = TIME_LIMIT) -> list:
    out = []
    if r.status == "smem" or smem_bytes(r) > H200_SMEM:
        out.append("SMEM>227K")
    if r.status == "timeout" or r.seconds > time_limit:
        out.append(f"TIME>{time_limit:.0f}s")
    if r.status in ("error", "memory", "crash"):
        out.append(f"FAIL({r.status})")
    if r.status == "ok":
        if r.get("spill_stores") or r.get("spill_loads") or r.get("stack") or r.get("local"):
            out.append("SPILL")
        at_v4_dims = not where.startswith("tiny")  # the tiny scenarios' fp32 model takes the fp32 form
        if r.spec.name in MMA_KERNELS and (r.spec.constexpr("MMA") is True or at_v4_dims) and not r.get("mma"):
            out.append("NO-MMA")
    return out


def row(r, where: str = "", time_limit: float = TIME_LIMIT) -> dict:
    """One spec's numbers, as the report and the JSON output hold them."""
    return {"kernel": r.spec.name, "where": where, "spec": r.spec.short(), "status": r.status,
            "seconds": round(r.seconds, 1), "cached": bool(r.get("cached", False)), "reg": r.get("reg"),
            "smem": smem_bytes(r), "spill_stores": r.get("spill_stores"), "stack": r.get("stack"),
            "mma": r.get("mma"), "mma_ops": r.get("mma_ops", []), "ffma": r.get("ffma"), "sass": r.get("sass"),
            "flags": flags(r, where, time_limit), "error": r.get("error", "")[-500:] if r.get("error") else ""}


def summary(results, wheres, time_limit: float = TIME_LIMIT) -> tuple:
    """(markdown table per kernel, verdict line, number of flagged specs)."""
    per = defaultdict(list)
    for r, w in zip(results, wheres):
        per[r.spec.name].append((r, w))
    lines = ["| kernel | specs | max REG | max smem KB | spilling | max spill B | max STACK B | compile s sum / max "
             "| min MMA | max FFMA | flags |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    bad = 0
    for name in sorted(per):
        rs = per[name]
        fl = defaultdict(int)
        for r, w in rs:
            for f in flags(r, w, time_limit):
                fl[f] += 1
            bad += bool(flags(r, w, time_limit))
        ok = [r for r, _ in rs if r.status == "ok"]
        spilling = sum("SPILL" in flags(r, w, time_limit) for r, w in rs)
        secs = [r.seconds for r, _ in rs]
        lines.append(
            f"| `{name}` | {len(rs)} | {max((r.get('reg') or 0 for r in ok), default='-')} "
            f"| {max(smem_bytes(r) for r, _ in rs) / 1024:.1f} | {spilling} / {len(rs)} "
            f"| {max((r.get('spill_stores') or 0 for r in ok), default='-')} "
            f"| {max((r.get('stack') or 0 for r in ok), default='-')} | {sum(secs):.0f} / {max(secs):.0f} "
            f"| {min((r.get('mma') or 0 for r in ok), default='-')} | {max((r.get('ffma') or 0 for r in ok), default='-')} "
            f"| {', '.join(f'{k} x{v}' for k, v in sorted(fl.items())) or 'clean'} |")
    verdict = f"{len(results) - bad}/{len(results)} specialisations clean"
    return "\n".join(lines), verdict, bad
