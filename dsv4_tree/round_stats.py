"""Per-round accounting of generate / generate_batch: draft and verify time, draft steps run.

`GenerateStats` (generate.py) holds the lists; these helpers fill them from a round and tell
the drafter the round is over (`end_round`, which the adaptive MTP drafter learns from)."""
from __future__ import annotations

import time


def timed_draft(drafter, engine, requests) -> tuple:
    """(trees, seconds) of one draft call."""
    t0 = time.perf_counter()
    trees = drafter.draft(engine, requests)
    return trees, time.perf_counter() - t0


def end_round(drafter, requests) -> None:
    """After commit: a drafter with end_round(requests) learns what this round did."""
    hook = getattr(drafter, "end_round", None)
    if callable(hook):
        hook(requests)


def note_round(stats, drafter, draft_seconds: float, verify_seconds: float) -> None:
    """Append one round's draft / verify seconds and draft steps (None: the drafter does not
    draft in steps) to a GenerateStats; keep the drafter's steps allowed and depth state."""
    stats.round_draft_seconds.append(draft_seconds)
    stats.round_verify_seconds.append(verify_seconds)
    last = getattr(drafter, "last_round", None)
    stats.draft_steps.append(None if last is None else last.steps)
    if last is not None:
        stats.steps_allowed = getattr(drafter, "shape").num_steps
    policy = getattr(drafter, "policy", None)
    if policy is not None:
        stats.depth = policy.state()


def describe(stats) -> str:
    """One line: steps run of allowed, mean draft / verify ms per round, calibration."""
    steps = [s for s in stats.draft_steps if s is not None]
    n = max(1, len(stats.round_draft_seconds))
    line = (f"draft {1e3 * sum(stats.round_draft_seconds) / n:.2f} ms/round, "
            f"verify {1e3 * sum(stats.round_verify_seconds) / n:.2f} ms/round")
    if steps:
        line = f"draft steps {sum(steps) / len(steps):.2f} of {stats.steps_allowed} per round; " + line
    if stats.depth is not None:
        line += "; calibration by depth " + " ".join(f"{c:.2f}" for c in stats.depth.calibration)
    return line
