"""What a verify step costs: the price list the batch budget is chosen against (budget/verify_budget.py).

Every table answers `theta(tau, R)`: for budgets b = 0 .. len(tau) - 1 extra verify nodes over a
batch of R requests (R + b nodes in all), the rate theta(b) = tau[b] / seconds(R, R + b) (or
tau[b] x steps/s) and the seconds, or None where the table knows rates only.

* `StepsPerSecondTable`: SGLang's `SpsCostTable` (steps/s by verify batch tokens, floor lookup);
* `AdditiveTable`: SGLang's `SpsAdditiveCostTable` (bias + alpha(R) + theta(R + b), interpolated,
  clamped to the probes);
* `LineTable`: ours, what `profile_costs` measures (budget/cost_profile.py): per batch size a
  line, seconds = base + per_node x total nodes, interpolated in R and clamped to the measured sizes;
* `MeasuredCosts`: the same lines learnt online from the run's own rounds (a `CostLine` per batch
  size, through the median of each total's recent samples), when no table is given.

`load_cost_table(path)` reads our JSON and SGLang's two formats (SGLang's profiler writes them)."""
from __future__ import annotations

import bisect
import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..errors import ConfigError

WINDOW = 8  # online samples kept per total: a line goes through each total's median
STALE = 64  # rounds (at a batch size) after which an online sample no longer counts
PROBE_EVERY = 16  # online: rounds between probes of the budget far from the choice
LINES_FORMAT = "dsv4_tree.cost_lines"


def _numbers(name: str, values, positive: bool = False) -> None:
    """Each of `values` a finite real number (not a bool or a string), >= 0 (> 0 where positive):
    probes, seconds and rates as SGLang's own loader takes them."""
    if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__iter__"):
        raise ConfigError(f"cost table: {name} must be a list of numbers, got {values!r:.80}")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not np.isfinite(v):
            raise ConfigError(f"cost table: {name} must hold finite numbers, got {v!r:.40} in {list(values)!r:.80}")
        if v < 0 or positive and v == 0:
            raise ConfigError(f"cost table: {name} must be {'> 0' if positive else '>= 0'}, got {v!r}")


def _check_probes(name: str, probes, values) -> None:
    if not probes:
        raise ConfigError(f"cost table: {name} needs at least one probe")
    if list(probes) != sorted(set(probes)):
        raise ConfigError(f"cost table: {name} must be strictly increasing, got {list(probes)}")
    if len(probes) != len(values):
        raise ConfigError(f"cost table: {name} has {len(probes)} probes for {len(values)} values")


def _interp(xs, ys, x: float) -> float:
    """Piecewise-linear through (xs, ys), constant beyond the ends."""
    if x <= xs[0]:
        return float(ys[0])
    if x >= xs[-1]:
        return float(ys[-1])
    hi = bisect.bisect_right(xs, x)
    frac = (x - xs[hi - 1]) / (xs[hi] - xs[hi - 1])
    return float(ys[hi - 1] + frac * (ys[hi] - ys[hi - 1]))


@dataclass(frozen=True)
class StepsPerSecondTable:
    """SGLang's SpsCostTable: steps/s measured at verify batch tokens, read at the largest probe <= B."""

    sample_batch_tokens: tuple
    sample_steps_per_sec: tuple
    max_batch_tokens: int

    def __post_init__(self) -> None:
        _numbers("sample_batch_tokens", self.sample_batch_tokens)
        _numbers("sample_steps_per_sec", self.sample_steps_per_sec, positive=True)
        _numbers("max_batch_tokens", (self.max_batch_tokens,))
        _check_probes("sample_batch_tokens", self.sample_batch_tokens, self.sample_steps_per_sec)
        if self.max_batch_tokens < self.sample_batch_tokens[-1]:
            raise ConfigError(f"cost table: max_batch_tokens={self.max_batch_tokens} is below the largest probe "
                              f"{self.sample_batch_tokens[-1]}")

    def theta(self, tau: torch.Tensor, num_requests: int):
        probes = torch.tensor(self.sample_batch_tokens, dtype=torch.int64)
        tokens = num_requests + torch.arange(tau.numel(), dtype=torch.int64)
        idx = (torch.bucketize(tokens, probes, right=True) - 1).clamp(0, probes.numel() - 1)
        sps = torch.tensor(self.sample_steps_per_sec, dtype=torch.float64)[idx].to(tau.device)  # host table, one copy
        return tau * sps, torch.where(sps > 0, 1.0 / sps, torch.full_like(sps, float("inf")))


@dataclass(frozen=True)
class AdditiveTable:
    """SGLang's SpsAdditiveCostTable: seconds = bias + alpha(R) + theta(R + b)."""

    bias_seconds: float
    bs_probes: tuple
    alpha_seconds: tuple
    m_probes: tuple
    theta_seconds: tuple

    def __post_init__(self) -> None:
        _numbers("bias_seconds", (self.bias_seconds,), positive=True)
        for name in ("bs_probes", "alpha_seconds", "m_probes", "theta_seconds"):
            _numbers(name, getattr(self, name))
        _check_probes("bs_probes", self.bs_probes, self.alpha_seconds)
        _check_probes("m_probes", self.m_probes, self.theta_seconds)

    def seconds(self, num_requests: int, count: int) -> torch.Tensor:
        """Step seconds at R + b verify tokens, b = 0 .. count - 1."""
        floor = self.bias_seconds + _interp(self.bs_probes, self.alpha_seconds, float(num_requests))
        xs = torch.tensor(self.m_probes, dtype=torch.float64)
        ys = torch.tensor(self.theta_seconds, dtype=torch.float64)
        m = (num_requests + torch.arange(count, dtype=torch.float64)).clamp(min=float(self.m_probes[0]),
                                                                          max=float(self.m_probes[-1]))
        if xs.numel() == 1:
            return floor + ys[0].expand(count)
        hi = torch.bucketize(m, xs, right=True).clamp(1, xs.numel() - 1)
        frac = (m - xs[hi - 1]) / (xs[hi] - xs[hi - 1]).clamp(min=1e-9)
        return floor + (ys[hi - 1] + frac * (ys[hi] - ys[hi - 1]))

    def theta(self, tau: torch.Tensor, num_requests: int):
        step = self.seconds(num_requests, tau.numel()).to(tau.device)  # host table, one copy
        return tau / step, step


@dataclass(frozen=True)
class LineTable:
    """Ours: at each measured batch size R_i, seconds = base_i + per_node_i x (total verify nodes);
    between sizes both interpolate linearly in R, beyond them they hold the nearest size's."""

    batch_sizes: tuple
    base_seconds: tuple
    seconds_per_node: tuple
    note: str = ""  # where and how it was measured

    def __post_init__(self) -> None:
        for name in ("batch_sizes", "base_seconds", "seconds_per_node"):
            _numbers(name, getattr(self, name))
        _check_probes("batch_sizes", self.batch_sizes, self.base_seconds)
        if len(self.seconds_per_node) != len(self.batch_sizes):
            raise ConfigError(f"cost table: seconds_per_node has {len(self.seconds_per_node)} values for "
                              f"{len(self.batch_sizes)} batch sizes")

    def line(self, num_requests: int) -> tuple:
        r = float(num_requests)
        return _interp(self.batch_sizes, self.base_seconds, r), _interp(self.batch_sizes, self.seconds_per_node, r)

    def theta(self, tau: torch.Tensor, num_requests: int):
        return _line_theta(tau, num_requests, self.line(num_requests))

    def to_json(self) -> str:
        return json.dumps({"format": LINES_FORMAT, **asdict(self)})

    def save(self, path) -> None:
        Path(path).write_text(self.to_json() + "\n", encoding="utf-8")


def _line_theta(tau: torch.Tensor, num_requests: int, line: tuple):
    base, per_node = line
    totals = num_requests + torch.arange(tau.numel(), dtype=torch.float64, device=tau.device)
    step = (base + per_node * totals).clamp(min=1e-12)
    return tau / step, step


def load_cost_table(path):
    """A LineTable (ours) or SGLang's SpsCostTable / SpsAdditiveCostTable JSON -> its table here."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ConfigError(f"cost table file not found: {path}") from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: not a readable JSON cost table: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a cost table is a JSON object, got {type(data).__name__}")
    kinds = {LINES_FORMAT: (LineTable, ("batch_sizes", "base_seconds", "seconds_per_node")),
             "additive": (AdditiveTable, ("bias_seconds", "bs_probes", "alpha_seconds", "m_probes", "theta_seconds")),
             "sps": (StepsPerSecondTable, ("sample_batch_tokens", "sample_steps_per_sec", "max_batch_tokens"))}
    kind = data.get("format", "additive" if "bias_seconds" in data else "sps")
    if kind not in kinds:
        raise ConfigError(f"{path}: unknown cost table format {kind!r}")
    cls, keys = kinds[kind]
    missing = [k for k in keys if k not in data]
    if missing:
        raise ConfigError(f"{path}: cost table ({cls.__name__}) lacks {missing}")
    args = {k: tuple(data[k]) if isinstance(data[k], list) else data[k] for k in keys}
    if cls is LineTable:
        args["note"] = str(data.get("note", ""))
    try:
        return cls(**args)
    except TypeError as exc:
        raise ConfigError(f"{path}: malformed cost table: {exc}") from exc
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from exc


@dataclass
class CostLine:
    """Round seconds against total verify nodes at one batch size: a least-squares line through the
    median of each total's recent samples (weighted by their count). Medians, because a shared
    machine's load only ever adds time, in spikes that a mean would follow. Refitted when a
    sample arrives (once a round), not when read."""

    samples: dict = field(default_factory=dict)  # total nodes -> [(round, seconds)], newest last
    rounds: int = 0
    last_probe: int = 0
    _fit: tuple | None = None

    def add(self, nodes: int, seconds: float) -> None:
        self.rounds += 1
        self.samples.setdefault(nodes, []).append((self.rounds, seconds))
        for n in list(self.samples):
            kept = [x for x in self.samples[n][-WINDOW:] if self.rounds - x[0] < STALE]
            if kept:
                self.samples[n] = kept
            else:
                del self.samples[n]
        self._fit = self._refit()

    def probe_due(self) -> bool:
        return self.rounds - self.last_probe >= PROBE_EVERY

    def line(self) -> tuple | None:
        """(seconds at 0 nodes, seconds per node), or None while fewer than two totals are measured."""
        return self._fit

    def _refit(self) -> tuple | None:
        if len(self.samples) < 2:
            return None
        n = np.array(list(self.samples), dtype=np.float64)
        t = np.array([statistics.median(x[1] for x in v) for v in self.samples.values()])
        w = np.array([len(v) for v in self.samples.values()], dtype=np.float64)
        nm, tm = (w * n).sum() / w.sum(), (w * t).sum() / w.sum()
        slope = (w * (n - nm) * (t - tm)).sum() / (w * (n - nm) ** 2).sum()
        slope = max(float(slope), 0.0)  # a noisy fit may tilt down: extra rows are never cheaper than none
        return max(float(tm - slope * nm), 0.0), slope


@dataclass
class MeasuredCosts:
    """Online lines per batch size (see the module docstring)."""

    lines: dict = field(default_factory=dict)  # batch size -> CostLine

    def ready(self, num_requests: int) -> bool:
        line = self.lines.get(num_requests)
        return line is not None and line.line() is not None

    def theta(self, tau: torch.Tensor, num_requests: int):
        return _line_theta(tau, num_requests, self.lines[num_requests].line())

    def add(self, num_requests: int, total_nodes: int, seconds: float) -> None:
        self.lines.setdefault(num_requests, CostLine()).add(total_nodes, seconds)

    def state(self) -> dict:
        return {b: c.line() for b, c in sorted(self.lines.items())}
