"""How often a drawn tree's chosen sibling is accepted once verify tries it (drafters/dspark_drawn.py).

A sibling of rank j (the j-th chosen token beside a spine node) is tried when verify reached its
parent and rejected the spine token and the siblings before it; it is then accepted with the
residual's mass at its token. The rate per rank is learnt from committed tokens after each
round, exactly: the emitted token after a reached node is the spine token when the spine was
accepted, a sibling's token when that sibling was, and neither otherwise (a rejected candidate's
token has no mass left in the residual). Rates start at PRIOR with PRIOR_TRIES pseudo-tries and
are read at draft time from past rounds only, so a round's shape never depends on its own
verify's draws."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..diagnostics import host_values

PRIOR = 0.25  # a sibling's acceptance once tried, before any round
PRIOR_TRIES = 8.0


@dataclass
class SiblingRate:
    ranks: int  # siblings per spine node at most (topk - 1)
    tries: list = field(default_factory=list)
    accepted: list = field(default_factory=list)
    _pending: tuple | None = None  # (request id -> (seq_len, tree)) of the last drawn round

    def __post_init__(self) -> None:
        self.tries = [0] * self.ranks
        self.accepted = [0] * self.ranks

    def rates(self, device=None) -> torch.Tensor:
        """[ranks] float64: each rank's acceptance once tried."""
        return torch.tensor([(a + PRIOR * PRIOR_TRIES) / (t + PRIOR_TRIES) for a, t in zip(self.accepted, self.tries)],
                            dtype=torch.float64, device=device)

    def drafted(self, requests, trees) -> None:
        self._pending = {r.request_id: (r.seq_len, t) for r, t in zip(requests, trees)}

    def end_round(self, requests) -> None:
        """Walk each drafted tree along what its request committed (host lists, host history)."""
        pending, self._pending = self._pending, None
        if not pending:
            return
        for req in requests:
            got = pending.get(req.request_id)
            if got is None or req.seq_len <= got[0]:
                continue
            start, tree = got
            emitted = host_values(req.tokens[start + 1 : req.seq_len]).tolist() + [req.root_token]
            self._walk(tree, emitted)

    def _walk(self, tree, emitted: list) -> None:
        tokens, parents = tree.host_lists()
        kids = [[] for _ in tokens]
        for i in range(1, len(tokens)):
            kids[parents[i]].append(i)
        u = 0
        for tok in emitted:
            if not kids[u]:
                return
            spine, others = kids[u][0], kids[u][1:]
            if tokens[spine] == tok:
                u = spine
                continue
            for j, s in enumerate(others):
                self.tries[j] += 1
                if tokens[s] == tok:
                    self.accepted[j] += 1
                    break
            return
