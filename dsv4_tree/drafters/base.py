"""The drafter protocol: given requests, return one DraftTree each (root = pending token)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ..errors import ConfigError, InputError
from ..executor.graphs import BucketGraphs
from ..tree.draft_tree import DraftTree


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


def draft_graphs(model, graphs, fn, who: str):
    """A drafter's `graphs=` argument -> BucketGraphs of fn, or None: True captures CUDA graphs
    (a CUDA model only), a callable is a capture function of executor/graphs.py's contract
    (eager_capture: the same replay path on any device), False / None draft eagerly."""
    if graphs is False or graphs is None:
        return None
    if graphs is True:
        if model.device.type != "cuda":
            raise ConfigError(f"{who} graphs=True captures drafts in CUDA graphs; the model is on {model.device} "
                              "(graphs=False there)")
        return BucketGraphs(fn)
    if not callable(graphs):
        raise ConfigError(f"{who} graphs must be True, False or a capture function, got {graphs!r}")
    return BucketGraphs(fn, capture=graphs)


def graphed_batch(engine, b: int) -> bool:
    """A draft of b requests may replay a captured one: a batch the engine graphs
    (SpecConfig.cuda_graph_max_bs, else max_requests), on one rank (a sharded model's draft runs
    eagerly: its collectives and the budget's broadcast stay out of the drafters' graphs)."""
    limit = engine.spec.cuda_graph_max_bs
    return engine.model.ranks is None and b <= (limit if limit is not None else engine.spec.max_requests)


def default_tree_nodes(topk: int, steps: int) -> int:
    """Nodes of a tree made out of a chain when only topk is given (the CLI's --topk, a DSpark
    tree in custom_generate): 2 per step plus the root's topk, or all that topk children per node
    over `steps` levels can offer."""
    return min(2 * steps + topk, 1 + topk + (steps - 1) * topk**2)


class Drafter(Protocol):
    def draft(self, engine, requests) -> list:
        """One DraftTree per request, tokens[0] == request.root_token."""


def check_drafted(drafter, requests, trees) -> None:
    """What `drafter.draft(engine, requests)` returned must be a list (or tuple) of one DraftTree
    per request, in the requests' order (tree b's root is requests[b]'s pending token); else
    InputError naming the drafter and what it returned (type, count, the bad element's index)."""
    name = type(drafter).__name__
    want = f"{name}.draft(engine, requests) must return a list of one DraftTree per request"
    if not isinstance(trees, (list, tuple)):
        raise InputError(f"{want}; it returned {_what(trees)}")
    if len(trees) != len(requests):
        raise InputError(f"{want}; it returned {len(trees)} trees for {len(requests)} requests")
    for b, (tree, req) in enumerate(zip(trees, requests)):
        if not isinstance(tree, DraftTree):
            raise InputError(f"{want}; element [{b}] of the {type(trees).__name__} it returned is {_what(tree)}")
        root = tree.host_lists()[0][0]
        if root != req.root_token:
            raise InputError(f"{want}, in the requests' order; tree [{b}] it returned has root token {root}, "
                             f"requests[{b}]'s pending root token is {req.root_token}")


def _what(value) -> str:
    """A short description of a value for an error message: its type, and shape or length."""
    if value is None:
        return "None"
    if hasattr(value, "shape"):
        return f"a {type(value).__name__} of shape {tuple(value.shape)}"
    if isinstance(value, (list, tuple, dict, set)):
        return f"a {type(value).__name__} of length {len(value)}"
    return f"a {type(value).__name__}"
