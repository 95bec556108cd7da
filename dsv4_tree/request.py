"""Request and VerifyOutput: a sequence's committed bookkeeping and one verify's result."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from .errors import StateError
from .executor.forward import RowsRun
from .serving.tables import VerifyPlan

_ids = itertools.count()


def check_live(requests) -> None:
    """StateError for a released request."""
    for req in requests:
        if getattr(req, "released", False):
            raise StateError(f"request {req.request_id} was released (Engine.release); start a new one with prefill")


@dataclass
class Request:
    """One sequence's committed state. seq_len = P committed (KV-ready) positions; root_token
    is the pending token at position P; row: its row in the engine's page tables. Only
    Engine.prefill / commit / release change it."""

    tokens: torch.Tensor  # [P] committed token ids
    root_token: int
    row: int
    seq_len: int = 0
    engine_id: int = 0  # the Engine that made it (its row indexes that engine's page tables)
    request_id: int = field(default_factory=lambda: next(_ids))
    # target residual streams (before hc_head) of the last rows the latest prefill/commit added
    # (at most sliding_window + 1 of them by default), positions seq_len - n .. seq_len - 1:
    # what an MTP drafter extends its sliding-window cache with
    new_hidden: torch.Tensor | None = field(default=None, repr=False)  # [n, hc_mult, hidden]
    # (committed row, C4 layer) pairs whose indexer top-k boundary was a (near-)tie, counted on
    # the model's device by prefill and commit; read it through committed_topk_ties
    ties: torch.Tensor | None = field(default=None, repr=False)  # [] int64
    released: bool = False  # set by Engine.release; a released request cannot be used again
    scratch_owner: int = field(default=0, repr=False)  # verify whose rows sit in this request's draft slots
    finalizer: object = field(default=None, repr=False, compare=False)  # returns the slots if never released

    @property
    def committed_topk_ties(self) -> int:
        """Indexer top-k boundary ties in the committed rows (prefill and every commit), summed
        over C4 layers: where our tie rule decided which entries a row attended. Reading it
        synchronises with the device."""
        return 0 if self.ties is None else int(self.ties)

    def _add_ties(self, ties: torch.Tensor) -> None:
        self.ties = ties if self.ties is None else self.ties + ties


@dataclass
class VerifyOutput:
    """logits[b]: [N_b, vocab], row i = node i of trees[b]. The rest is for commit."""

    logits: list
    plan: VerifyPlan = field(repr=False)
    run: RowsRun = field(repr=False)
    request_ids: tuple = ()
    seq_lens: tuple = ()
    verify_id: int = 0

    @property
    def topk_ties(self) -> int:
        """(Row, layer) pairs whose indexer top-k boundary was a (near-)tie (read from the device
        on access)."""
        return int(self.run.topk_ties[: self.plan.offsets[-1] + self.plan.num_nodes[-1]].sum())
