"""Accept events of DSpark tree candidates, and the fit of the node-value model g on them.

After each round the tokens a request committed say, for every candidate of its draft's pool
(verified or not) whose parent the accepted path reached, whether that candidate would have
been accepted: the target's next token there is the next emitted token (the accepted child's or
the bonus), so a candidate at depth d is "reached" when its parent's token is emitted token
d - 1 (depth 1: always) and "accepted" when its own token is emitted token d. Under greedy
acceptance that is the target's argmax; under sampling the emitted token is a draw from the
target, and the event's expectation is the target's probability of the candidate's token, which
is exactly the chance a fixed tree holding it would accept it. Unverified candidates count too,
so the events are not biased toward what the value model already picked.

Warm-up: the prior g serves until MIN_EVENTS events (with MIN_CLASS of each outcome) are in;
then the logistic is refitted every REFIT_EVERY rounds on the last MAX_EVENTS events. Fitting
reads past rounds only, so the values of a round never depend on its own verify's draws."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..diagnostics import host_values
from .node_values import FEATURES, PoolValues, ValueModel, fit_logistic

MIN_EVENTS = 256
MIN_CLASS = 16
REFIT_EVERY = 16  # rounds
MAX_EVENTS = 8192


@dataclass
class _Draft:
    request_ids: list
    seq_lens: list
    tokens: np.ndarray  # [B, P]
    parents: np.ndarray  # [B, P]
    depths: np.ndarray  # [P]
    features: np.ndarray  # [B, P, F]

    @classmethod
    def unpack(cls, request_ids: list, seq_lens: list, host: np.ndarray) -> "_Draft":
        """ValueLearner.payload's columns, read: [B, (3 + F) P] float64. Depths are the same for
        every request."""
        b, f = host.shape[0], len(FEATURES)
        p = host.shape[1] // (3 + f)
        return cls(request_ids, seq_lens, host[:, :p].astype(np.int64), host[:, p : 2 * p].astype(np.int64),
                   host[0, (2 + f) * p :].astype(np.int64), host[:, 2 * p : (2 + f) * p].reshape(b, p, f))


@dataclass
class ValueLearner:
    """The value model a tree drafter uses and the events it is fitted on."""

    model: ValueModel = field(default_factory=ValueModel)
    learn: bool = True  # False: keep `model` as given (a fitted model loaded by the caller)
    x: np.ndarray = field(default_factory=lambda: np.zeros((MAX_EVENTS, len(FEATURES))))
    y: np.ndarray = field(default_factory=lambda: np.zeros(MAX_EVENTS))
    count: int = 0  # events recorded in all (the buffers keep the last MAX_EVENTS)
    rounds: int = 0
    fitted_at: int | None = None  # round of the last fit
    _pending: _Draft | None = None

    def payload(self, tokens: torch.Tensor, pool: PoolValues) -> torch.Tensor | None:
        """What the round's draft read brings to the host for this learner (None: not learning):
        the pool's tokens [B, P], parents, features and depths packed as float64 [B, (3 + F) P]
        (float64 holds ids and depths exactly), on the pool's device."""
        if not self.learn:
            return None
        b, p = tokens.shape
        return torch.cat([tokens.to(torch.float64), pool.parents.to(torch.float64),
                          pool.features.reshape(b, -1).to(torch.float64), pool.depths.to(torch.float64).expand(b, p)], 1)

    def drafted(self, requests, host) -> None:
        """The round's pool as `payload` packed it, read on the host with the draft's trees
        (numpy [B, (3 + F) P]; None: not learning)."""
        self._pending = None if host is None or not self.learn else \
            _Draft.unpack([r.request_id for r in requests], [r.seq_len for r in requests], host)

    def end_round(self, requests) -> None:
        """The round's accept events from the committed tokens (host history: no device read,
        the pool came with the draft's read) and a refit when one is due."""
        pend, self._pending = self._pending, None
        if pend is None:
            return
        where = {rid: i for i, rid in enumerate(pend.request_ids)}
        rows, emitted = [], []
        for req in requests:
            i = where.get(req.request_id)
            if i is None or req.seq_len <= pend.seq_lens[i]:
                continue
            p0 = pend.seq_lens[i]
            rows.append(i)
            emitted.append(host_values(req.tokens[p0 + 1 : req.seq_len]).tolist() + [req.root_token])  # depths 1 .. m (host history)
        if rows:
            self._add(*batch_events(pend.tokens[rows], pend.parents[rows], pend.depths, pend.features[rows], emitted))
        self.rounds += 1
        self._maybe_fit()

    def _add(self, x: np.ndarray, y: np.ndarray) -> None:
        x, y = x[-MAX_EVENTS:], y[-MAX_EVENTS:]
        at = (self.count + np.arange(len(y))) % MAX_EVENTS  # a ring buffer of the last MAX_EVENTS
        self.x[at], self.y[at] = x, y
        self.count += len(y)

    def _maybe_fit(self) -> None:
        n = min(self.count, MAX_EVENTS)
        pos = int(self.y[:n].sum())
        if n < MIN_EVENTS or min(pos, n - pos) < MIN_CLASS:
            return
        if self.fitted_at is not None and self.rounds - self.fitted_at < REFIT_EVERY:
            return
        self.model = ValueModel(tuple(float(w) for w in fit_logistic(self.x[:n], self.y[:n])))
        self.fitted_at = self.rounds


def events(tokens: np.ndarray, parents: np.ndarray, depths: np.ndarray, feats: np.ndarray, emitted: list):
    """One request's pool (tokens [P], parent pool ids [P] (-1: the root), depths [P] 1-based,
    features [P, F]) and the tokens emitted after its root (depths 1 .. m) -> (x [n, F], y [n]) of
    every candidate whose parent was reached, at a depth whose emitted token is known."""
    return batch_events(tokens[None], parents[None], depths, feats[None], [emitted])


def batch_events(tokens: np.ndarray, parents: np.ndarray, depths: np.ndarray, feats: np.ndarray, emitted: list):
    """`events` for B requests at once (tokens, parents [B, P], feats [B, P, F], emitted: B lists),
    the events in request order, then pool order."""
    b, p = tokens.shape
    top = int(depths.max())
    m = np.array([len(e) for e in emitted])
    want = np.full((b, top + 1), -1, dtype=np.int64)
    for i, e in enumerate(emitted):
        k = min(len(e), top)
        want[i, 1 : k + 1] = e[:k]
    accepted = np.zeros((b, p), dtype=bool)
    reached = np.zeros((b, p), dtype=bool)
    rows = np.arange(b)[:, None]
    for d in range(1, top + 1):  # parents come at lower depths: fill depth by depth
        at = np.nonzero(depths == d)[0]
        par = parents[:, at]
        reach = np.ones(par.shape, dtype=bool) if d == 1 else accepted[rows, np.maximum(par, 0)] & (par >= 0)
        reach &= (d <= m)[:, None]
        reached[:, at] = reach
        accepted[:, at] = reach & (tokens[:, at] == want[:, d : d + 1])
    return feats[reached], accepted[reached].astype(np.float64)
