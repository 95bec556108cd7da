"""Per-round accounting of generate / generate_batch: draft and verify time, draft steps run.

`GenerateStats` (generate.py) holds the lists; these helpers fill them from a round and tell
the drafter the round is over (`end_round`, which the adaptive MTP drafter learns from)."""
from __future__ import annotations

import time

import torch


def settle(device) -> None:
    """Wait for the device's queued work, so a clock read after it times the work, not its
    launch (engine.verify returns logits still on the device; on a CPU nothing is queued)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed_verify(engine, requests, trees) -> tuple:
    """(VerifyOutput, seconds) of one verify call, the device's work included."""
    t0 = time.perf_counter()
    out = engine.verify(requests, trees)
    settle(engine.model.device)
    return out, time.perf_counter() - t0


def timed_draft(drafter, engine, requests) -> tuple:
    """(trees, seconds) of one draft call."""
    t0 = time.perf_counter()
    trees = drafter.draft(engine, requests)
    return trees, time.perf_counter() - t0


def end_round(drafter, requests, cut=()) -> None:
    """After commit: a drafter with end_round(requests, cut) learns what this round did; `cut`
    holds the ids of requests whose round was cut short of its draft (tree trimmed to the token
    budget, emission cut at EOS or the budget)."""
    hook = getattr(drafter, "end_round", None)
    if callable(hook):
        hook(requests, cut)


def note_round(stats, drafter, draft_seconds: float, verify_seconds: float) -> None:
    """Append one round's draft / verify seconds and draft steps (None: the drafter does not
    draft in steps) to a GenerateStats; keep the drafter's steps allowed and depth state."""
    stats.round_draft_seconds.append(draft_seconds)
    stats.round_verify_seconds.append(verify_seconds)
    last = getattr(drafter, "last_round", None)
    stats.draft_steps.append(None if last is None else last.steps)
    if last is not None:
        stats.steps_allowed = last.allowed
    policy = getattr(drafter, "policy", None)
    if policy is not None:
        stats.depth = policy.state()


def describe(stats) -> str:
    """One line: steps run of allowed, nodes per request-round, mean draft / verify ms per round,
    the adaptive policy's state."""
    steps = [s for s in stats.draft_steps if s is not None]
    n = max(1, len(stats.round_draft_seconds))
    line = (f"draft {1e3 * sum(stats.round_draft_seconds) / n:.2f} ms/round, "
            f"verify {1e3 * sum(stats.round_verify_seconds) / n:.2f} ms/round")
    if stats.round_nodes:
        line = f"nodes {stats.mean_nodes_per_round:.2f} per request-round; " + line
    if steps:
        line = f"draft steps {sum(steps) / len(steps):.2f} of {stats.steps_allowed} per round; " + line
    if hasattr(stats.depth, "describe"):
        line += "; " + stats.depth.describe()
    elif stats.depth is not None:
        line += "; calibration by depth " + " ".join(f"{c:.2f}" for c in stats.depth.calibration)
    return line
