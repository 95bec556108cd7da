"""The drafter protocol: given requests, return one DraftTree each (root = pending token)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ..errors import ConfigError


@dataclass(frozen=True)
class TreeShape:
    """Limits a drafter must respect: at most topk children per node, depth <= num_steps,
    at most num_draft_tokens nodes (root included)."""

    topk: int
    num_steps: int
    num_draft_tokens: int

    def __post_init__(self) -> None:
        for name in ("topk", "num_steps", "num_draft_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(f"TreeShape.{name} must be an int, got {value!r}")
            if value < 1:
                raise ConfigError(f"TreeShape.{name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def from_spec(cls, spec) -> "TreeShape":
        return cls(spec.eagle_topk, spec.num_steps, spec.num_draft_tokens)


class Drafter(Protocol):
    def draft(self, engine, requests) -> list:
        """One DraftTree per request, tokens[0] == request.root_token."""
