"""How many draft nodes a verify step checks, for the whole batch (design_notes/verify-budget.md).

SGLang 0.5.23's confidence-scheduled DSpark verify (its `compact` ragged mode), written here for
our engine, and its generalisation from chain positions to tree nodes:

* survival a_{r,j} = prod_{i<=j} c_{r,i}: the confidence head's chance that request r's draft j
  and every draft before it are accepted (`survival`);
* the batch budget b (extra verify tokens beyond each request's root) maximises
  theta(b) = tau*(b) / seconds(R + b), tau*(b) = R + the sum of the b best candidate values
  over the whole batch, seconds from a measured cost table (`choose_budget`; budget/cost_table.py);
* the shape: the b best candidates of the batch, in one order that does not depend on how the
  values compare beyond ties: value descending, then depth, then request, then candidate id
  (`verify_lens` for chains, `pick_nodes` for trees). A candidate's value never exceeds its
  parent's and its depth is larger, so every pick is ancestor-closed.

Pure functions of tensors (CPU, float64 where values are summed or compared), no state; the
policy that feeds them lagged or current values lives in budget/budget_policy.py."""
from __future__ import annotations

from dataclasses import dataclass

import torch

SURVIVAL_EPS = 1e-6  # candidates worth less never count (SGLang's DSparkScheduleConfig.survival_eps)


@dataclass(frozen=True)
class BudgetChoice:
    """One budget decision: b extra nodes for the batch, the predicted seconds of the step and theta."""

    budget: int
    seconds: float | None
    theta: float


def survival(confidence: torch.Tensor) -> torch.Tensor:
    """confidence [R, gamma] (c_j: draft j survives given drafts < j did) -> cumulative product, fp32."""
    return torch.cumprod(confidence.to(torch.float32), dim=1)


def budget_from_sorted(values: torch.Tensor, num_requests: int, table) -> BudgetChoice:
    """values [n] float64, best first: the candidates a budget of b takes are the first b.
    -> the b in [0, n] maximising tau*(b) against the table's price of R + b verify tokens."""
    tau = num_requests + torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(values, 0)])
    theta, seconds = table.theta(tau, num_requests)
    best = int(torch.argmax(theta))  # the first maximum: the smallest budget among equals
    return BudgetChoice(best, None if seconds is None else float(seconds[best]), float(theta[best]))


def choose_budget(survival_probs: torch.Tensor, table, max_len: int | None = None,
                  eps: float = SURVIVAL_EPS) -> BudgetChoice:
    """SGLang's chain budget: survival_probs [R, gamma] (lagged, for a chain: see budget_policy);
    candidates are the first max_len columns (default gamma + 1, i.e. all) worth >= eps."""
    r, gamma = survival_probs.shape
    window = survival_probs[:, : (max_len or gamma + 1)].reshape(-1)
    values = window[window >= eps].to(torch.float64)
    return budget_from_sorted(torch.sort(values, descending=True).values, r, table)


def pick_order(values: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
    """values [R, P], depths [P] -> flat indices r * P + c of every candidate, in pick order:
    value descending, then depth, then request, then candidate id. Successive stable sorts,
    least significant key first."""
    r, p = values.shape
    flat_v = values.reshape(-1).to(torch.float64)
    flat_d = depths.reshape(1, p).expand(r, p).reshape(-1)
    order = torch.arange(r * p, device=values.device)  # request-major: request, then candidate id, already in order
    order = order[torch.argsort(flat_d[order], stable=True)]
    return order[torch.argsort(-flat_v[order], stable=True)]


def verify_lens(confidence: torch.Tensor, budget: int, min_len: int = 1, max_len: int | None = None,
                eps: float = SURVIVAL_EPS) -> torch.Tensor:
    """SGLang's chain shape: the `budget` best of this step's survival over the whole batch.
    confidence [R, gamma] -> verify length per request (root included) [R] int64, in
    [max(min_len, 1), max_len] (default gamma + 1)."""
    r = confidence.shape[0]
    top, cols, valid, order = _lens_order(confidence, max_len, eps)
    order = order[: min(int(budget), r * cols)]
    chosen = valid.reshape(-1)[order].to(torch.int64)  # an invalid candidate takes a slot, adds nothing
    extra = torch.zeros(r, dtype=torch.int64).index_add_(0, order // cols, chosen)
    return (min_len + extra).clamp(min=max(min_len, 1), max=top)


def _lens_order(confidence: torch.Tensor, max_len: int | None, eps: float) -> tuple:
    """(top, columns, valid [R, cols], every candidate in pick order): what both verify-length
    forms take the first `budget` of."""
    top = max_len or confidence.shape[1] + 1
    window = survival(confidence)[:, :top].to(torch.float64)
    valid = window >= eps
    masked = torch.where(valid, window, torch.full_like(window, float("-inf")))
    return top, window.shape[1], valid, pick_order(masked, torch.arange(window.shape[1], device=window.device))


def verify_lens_fixed(confidence: torch.Tensor, budget, min_len: int = 1, max_len: int | None = None,
                      eps: float = SURVIVAL_EPS) -> torch.Tensor:
    """`verify_lens` at a fixed shape on the confidences' device: budget an int or a 0-dim
    tensor (not read), the same lengths [R] int64."""
    r, dev = confidence.shape[0], confidence.device
    top, cols, valid, order = _lens_order(confidence, max_len, eps)
    take = torch.arange(order.numel(), device=dev) < budget
    chosen = (valid.reshape(-1)[order] & take).to(torch.int64)  # an invalid candidate takes a slot, adds nothing
    extra = torch.zeros(r, dtype=torch.int64, device=dev).index_add_(0, order // cols, chosen)
    return (min_len + extra).clamp(min=max(min_len, 1), max=top)


def marginal_value(confidence: torch.Tensor, budget, eps: float = SURVIVAL_EPS) -> torch.Tensor:
    """The survival of the last candidate `verify_lens_fixed(confidence, budget)` takes: the
    price per node that budget paid (0-dim float64 on the confidences' device; +inf for a budget
    of 0, eps at least)."""
    window = survival(confidence).reshape(-1).to(torch.float64)
    ranked = torch.sort(torch.where(window >= eps, window, torch.zeros_like(window)), descending=True).values
    b = torch.as_tensor(budget, device=window.device).to(torch.int64)
    last = ranked.index_select(0, (b - 1).clamp(min=0, max=window.numel() - 1).reshape(1))[0]
    return torch.where(b > 0, last.clamp(min=eps), torch.full_like(last, float("inf")))


@dataclass(frozen=True)
class NodePick:
    """The eligible candidates of a batch in pick order, and how many a budget takes."""

    order: torch.Tensor  # [n] flat indices r * P + c, eligible only (valid, within each request's cap)
    values: torch.Tensor  # [n] float64, their values


def _ordered(values: torch.Tensor, depths: torch.Tensor, cap: int, eps: float) -> tuple:
    """Every candidate in pick order: (flat indices [R * P], their values float64, eligible:
    worth >= eps and among its request's first `cap` in that order). Fixed shapes."""
    p = values.shape[1]
    order = pick_order(values, depths)
    flat = values.reshape(-1).to(torch.float64)[order]
    req = order // p
    # each candidate's rank within its own request in pick order: a stable sort by request, then
    # the position within that request's run (every request has P candidates: its run starts at
    # r * P; a bincount would size its output from the largest value, a host read on a GPU)
    by_req = torch.argsort(req, stable=True)
    ar = torch.arange(order.numel(), device=values.device)
    rank = torch.empty_like(order).scatter_(0, by_req, ar - req[by_req] * p)
    return order, flat, (flat >= eps) & (rank < cap)


def eligible(values: torch.Tensor, depths: torch.Tensor, cap: int, eps: float = SURVIVAL_EPS) -> NodePick:
    """values [R, P] candidate values (ancestor-monotone), depths [P], cap: extra nodes a request
    may get (num_draft_tokens - 1) -> the candidates in pick order that a budget may take: worth
    >= eps and among their request's first `cap` in that order (a request at its cap takes no
    more; its later candidates are all descendants or worse, so the pick stays ancestor-closed)."""
    order, flat, keep = _ordered(values, depths, cap, eps)
    return NodePick(order[keep], flat[keep])


def pick_nodes(pick: NodePick, shape: tuple, budget: int) -> torch.Tensor:
    """The first `budget` eligible candidates -> chosen mask [R, P] bool."""
    mask = torch.zeros(shape[0] * shape[1], dtype=torch.bool)
    mask[pick.order[: max(0, int(budget))]] = True
    return mask.view(shape)


@dataclass(frozen=True)
class FixedPick:
    """`eligible` at a fixed shape (no host read): every candidate of the batch in pick order,
    the eligible ones first. order [M] flat indices r * P + c (M = R * P); values [M] float64,
    0 past the eligible ones; count: a 0-dim tensor, how many are eligible."""

    order: torch.Tensor
    values: torch.Tensor
    count: torch.Tensor


def eligible_fixed(values: torch.Tensor, depths: torch.Tensor, cap: int, eps: float = SURVIVAL_EPS) -> FixedPick:
    """`eligible`'s candidates in its order, kept at the batch's full size: the same tensors on
    any batch, no data-dependent shape (a CUDA graph can hold it)."""
    order, flat, keep = _ordered(values, depths, cap, eps)
    m = order.numel()
    ar = torch.arange(m, device=values.device)
    first = torch.argsort(torch.where(keep, ar, ar + m))  # eligible first, each part in pick order
    kept = keep[first]
    return FixedPick(order[first], torch.where(kept, flat[first], torch.zeros_like(flat)), kept.sum())


def lagged_pick(lagged: torch.Tensor, eps: float = SURVIVAL_EPS) -> FixedPick:
    """The chain budget's candidates at a fixed shape: the survivals of lagged [R, D] (each
    request's confidences `lag` rounds back; zero rows: padding, never eligible), best first."""
    window = survival(lagged).reshape(-1).to(torch.float64)
    keep = window >= eps
    first = torch.argsort(torch.where(keep, window, torch.full_like(window, float("-inf"))), descending=True,
                          stable=True)
    return FixedPick(first, torch.where(keep[first], window[first], torch.zeros_like(window)), keep.sum())


def budget_fixed(pick: FixedPick, num_requests: int, table) -> tuple:
    """`budget_from_sorted` over a FixedPick: theta at every b in [0, M] (past the eligible count
    -inf), the first maximum. -> (b, seconds, theta), 0-dim tensors on the pick's device."""
    m = pick.values.numel()
    tau = num_requests + torch.cat([pick.values.new_zeros(1), torch.cumsum(pick.values, 0)])
    theta, seconds = table.theta(tau, num_requests)
    b = torch.arange(m + 1, device=tau.device)
    theta = torch.where(b <= pick.count, theta, torch.full_like(theta, float("-inf")))
    best = torch.argmax(theta)  # the first maximum: the smallest budget among equals
    at = best.view(1)  # index_select: a 0-dim index in [] would be read on the host
    return best, (seconds.index_select(0, at)[0] if seconds is not None else None), theta.index_select(0, at)[0]


def chosen_fixed(pick: FixedPick, shape: tuple, budget: torch.Tensor) -> torch.Tensor:
    """The first `budget` eligible candidates -> chosen mask [R, P] bool (budget: an int or a
    0-dim tensor, at most the eligible count)."""
    m = pick.order.numel()
    take = torch.arange(m, device=pick.order.device) < budget
    return torch.zeros(m, dtype=torch.bool, device=pick.order.device).scatter_(0, pick.order, take).view(shape)
