"""Values of DSpark tree candidates: v(n) = v(parent) x g(c, p, rank) (design_notes/verify-budget.md).

c is the confidence head's output for the node's parent (the chance that the parent's sampled
child survives, given the parent was accepted), p the node's probability under its parent's
Markov-biased distribution, rank its place among the parent's top-K children. g is the chance
that the node is accepted given its parent was; v(root) = 1, so v(n) estimates the chance the
accepted path reaches n, and a tree's expected tokens are 1 + the sum of its nodes' values.

* **Prior** (`prior_share`, before any fit): rank 0 gets c, rank j > 0 gets (1 - c) p_j / (1 - p_0):
  the mass the parent's best child leaves, shared in proportion to the draft's probabilities.
* **Fitted** (`ValueModel.weights`): a logistic g = sigmoid(w . f) over f = [1, logit(prior),
  logit(c), log p, rank == 0], fitted on accept events (budget/value_events.py), siblings
  scaled so their shares sum to at most 1 (at most one child of a node is accepted).

g <= 1, so no child outvalues its parent: picks by value are ancestor-closed."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import ConfigError

FEATURES = ("bias", "logit_prior", "logit_confidence", "log_prob", "rank0")
CLIP = 1e-6  # probabilities enter the features clipped to [CLIP, 1 - CLIP]


def prior_share(probs: torch.Tensor, conf: torch.Tensor) -> torch.Tensor:
    """probs [..., K] a parent's top-K child probabilities (sorted), conf [...] its confidence ->
    [..., K] each child's share of the parent's value: rank 0 c, rank j (1 - c) p_j / (1 - p_0)."""
    rest = 1.0 - probs[..., :1]
    share = torch.where(rest > 0, probs / rest.clamp_min(torch.finfo(probs.dtype).tiny), torch.zeros_like(probs))
    c = conf.unsqueeze(-1).to(probs.dtype)
    out = (1.0 - c) * share.clamp(max=1.0)
    return torch.cat([c.expand_as(out[..., :1]), out[..., 1:]], -1)


def _logit(x: torch.Tensor) -> torch.Tensor:
    x = x.clamp(CLIP, 1 - CLIP)
    return torch.log(x) - torch.log1p(-x)


def features(probs: torch.Tensor, conf: torch.Tensor) -> torch.Tensor:
    """probs [..., K], conf [...] -> f [..., K, len(FEATURES)] float64 (FEATURES' order)."""
    probs = probs.to(torch.float64)
    c = conf.to(torch.float64).unsqueeze(-1).expand_as(probs)
    rank0 = torch.zeros_like(probs)
    rank0[..., 0] = 1.0
    return torch.stack([torch.ones_like(probs), _logit(prior_share(probs, conf.to(torch.float64))), _logit(c),
                        torch.log(probs.clamp(min=CLIP)), rank0], -1)


def share_with(weights: torch.Tensor | None, probs: torch.Tensor, conf: torch.Tensor,
               feats: torch.Tensor | None = None) -> torch.Tensor:
    """ValueModel.share with its weights as a float64 tensor [F] on the device (None: the prior):
    what a captured draft reads from a static buffer."""
    if weights is None:
        return prior_share(probs.to(torch.float64), conf.to(torch.float64))
    f = features(probs, conf) if feats is None else feats
    g = torch.sigmoid(f @ weights)
    return g / g.sum(-1, keepdim=True).clamp(min=1.0)


@dataclass(frozen=True)
class ValueModel:
    """g: the prior (weights None) or a fitted logistic (weights in FEATURES' order)."""

    weights: tuple | None = None

    def __post_init__(self) -> None:
        w = self.weights
        if w is None:
            return
        numbers = isinstance(w, (tuple, list)) and all(
            isinstance(x, (int, float, np.floating, np.integer)) and not isinstance(x, bool) for x in w)
        if not numbers or len(w) != len(FEATURES) or not all(np.isfinite(x) for x in w):
            raise ConfigError(f"ValueModel.weights must be {len(FEATURES)} finite numbers ({', '.join(FEATURES)}), "
                              f"got {w!r}")
        object.__setattr__(self, "weights", tuple(float(x) for x in w))

    def share(self, probs: torch.Tensor, conf: torch.Tensor, feats: torch.Tensor | None = None) -> torch.Tensor:
        """[..., K] g of each child of each parent, float64 (feats: `features(probs, conf)` when
        the caller has them already)."""
        w = None if self.weights is None else torch.tensor(self.weights, dtype=torch.float64, device=probs.device)
        return share_with(w, probs, conf, feats)

    def to_json(self) -> str:
        return json.dumps({"features": list(FEATURES), "weights": None if self.weights is None else list(self.weights)})

    @classmethod
    def from_json(cls, text: str) -> "ValueModel":
        """A model from `to_json`'s text; ConfigError naming what is wrong with any other."""
        if not isinstance(text, (str, bytes)):
            raise ConfigError(f"ValueModel.from_json takes JSON text, got {type(text).__name__}")
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"a ValueModel's JSON does not parse: {exc}") from exc
        if not isinstance(data, dict) or data.get("features") != list(FEATURES):
            raise ConfigError(f"a ValueModel's JSON must be an object naming features {list(FEATURES)}")
        w = data.get("weights")
        if w is not None and not isinstance(w, list):
            raise ConfigError(f"a ValueModel's JSON weights must be a list of {len(FEATURES)} numbers or null, "
                              f"got {w!r}")
        return cls(None if w is None else tuple(w))


def as_value_model(values) -> ValueModel:
    """A DSpark drafter's `values=` argument as a ValueModel: a ValueModel, its JSON text
    (`ValueModel.to_json`) or the path of a file holding it; ConfigError for anything else."""
    if isinstance(values, ValueModel):
        return values
    if hasattr(values, "__fspath__") or isinstance(values, str) and not values.lstrip().startswith("{"):
        try:
            values = Path(values).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"values: cannot read a ValueModel file {values}: {exc}") from exc
    if isinstance(values, str):
        return ValueModel.from_json(values)
    raise ConfigError(f"values must be a ValueModel (budget/node_values.py), its JSON text or a path to it, "
                      f"got {type(values).__name__} {values!r:.80}")


def fit_logistic(x: np.ndarray, y: np.ndarray, l2: float = 1.0, iters: int = 30) -> np.ndarray:
    """Weights of an L2-regularised logistic regression (Newton's method): x [n, F], y [n] in {0, 1}.
    The bias (column 0) is not penalised."""
    n, f = x.shape
    w = np.zeros(f)
    reg = np.full(f, l2)
    reg[0] = 0.0
    for _ in range(iters):
        p = 1.0 / (1.0 + np.exp(-np.clip(x @ w, -40, 40)))
        grad = x.T @ (p - y) + reg * w
        hess = (x * (p * (1 - p))[:, None]).T @ x + np.diag(reg + 1e-9)
        step = np.linalg.solve(hess, grad)
        w -= step
        if np.abs(step).max() < 1e-9:
            break
    return w


@dataclass
class PoolValues:
    """Every candidate of a batch's expansion, in organize_draft_results' pool order."""

    values: torch.Tensor  # [B, P] float64: v(n)
    depths: torch.Tensor  # [P] 1-based
    parents: torch.Tensor  # [B, P] pool index of the parent, -1 for the root's children
    features: torch.Tensor  # [B, P, F] float64: g's inputs, for the accept events


def pool_values(exp, model: ValueModel, topk: int) -> PoolValues:
    """v of every candidate of a MarkovExpansion (drafters/dspark_tree.py): depth by depth, the
    parent's value (gathered by its pool index) times the child's share. Features and shares are
    elementwise per parent, so they run once over every depth's parents stacked (a fixed number
    of ops whatever the depth); only the products walk the depths."""
    b = exp.token_list[0].shape[0]
    dev = exp.token_list[0].device  # on the expansion's device: no host copy
    probs = torch.cat([x.detach().reshape(b, -1, topk) for x in exp.prob_list], 1).to(torch.float64)  # [B, F, K]
    confs = torch.cat([x.detach().reshape(b, -1) for x in exp.confidence_list], 1).to(torch.float64)  # [B, F]
    f = features(probs, confs)  # [B, F, K, FEATURES]: the fitted g's inputs and the accept events'
    share = model.share(probs, confs, f).reshape(b, -1)  # [B, P]: pool order (parents in order, K children each)
    vals, depths, parents, at, prev_at = [], [], [], 0, 0
    for d in range(len(exp.prob_list)):
        width = exp.prob_list[d].reshape(b, -1, topk).shape[1] * topk
        s = share[:, at : at + width]
        if d == 0:
            par = torch.full((b, width), -1, dtype=torch.int64, device=dev)
            v = s
        else:
            # pool ids of depth d's frontier (organize_draft_results' parents_list: the first holds the root),
            # all at depth d - 1: their values are the previous depth's, from its first pool id on
            front = (exp.parents_list[0][:, 1:] if d == 1 else exp.parents_list[d - 1]).detach().long()
            par = front.unsqueeze(2).expand(b, front.shape[1], topk).reshape(b, -1)
            v = (vals[-1].gather(1, front - prev_at).unsqueeze(2) * s.view(b, -1, topk)).reshape(b, -1)
        vals.append(v)
        parents.append(par)
        depths.append(torch.full((width,), d + 1, dtype=torch.int64, device=dev))
        prev_at, at = at, at + width
    return PoolValues(torch.cat(vals, 1), torch.cat(depths), torch.cat(parents, 1), f.reshape(b, -1, len(FEATURES)))
