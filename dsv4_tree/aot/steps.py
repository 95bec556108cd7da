"""What a gate scenario runs: verify and prefill steps at one model size (scenarios.py runs
them, launch_rules.py derives them from the library's defaults)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Verify:
    """Verify steps of trees of `n` nodes for requests of committed lengths `contexts` (one
    request per length: bs = len(contexts)), then a greedy commit. Above 64 nodes the tree is a
    chain: the rows of a prefill chunk of n rows at that context. `pools`: the engine's
    kv_cache_dtype; `bucketed`: padded to its static-shape bucket, as every verify of at most
    max_requests requests is on CUDA (cuda_graph_max_bs None = max_requests there)."""

    n: int
    contexts: tuple
    pools: str = "fp8_e4m3"
    bucketed: bool = False
    max_requests: int = 2  # the engine's (the launch rules' steps: SpecConfig's default, 16)


@dataclass(frozen=True)
class Prefill:
    """A prefill of `length` tokens in chunks of `chunk` rows (`prompts` prompts of that length
    at once: prefill_batch)."""

    length: int
    chunk: int
    pools: str = "fp8_e4m3"
    prompts: int = 1
    max_requests: int = 2
    n: int = 8  # the engine's num_draft_tokens (its tables' per-request width reaches prefill launches)


@dataclass(frozen=True)
class Scenario:
    dims: str  # "tiny" | "flash" | "pro"
    steps: tuple  # Verify / Prefill
    extra: bool = False  # the launchers outside the verify step (pool_entries, indexer gather)
