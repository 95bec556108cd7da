"""Request and VerifyOutput: a sequence's committed bookkeeping and one verify's result."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from .errors import StateError
from .executor.forward import RowsRun
from .serving.tables import VerifyPlan

_ids = itertools.count()


class TokenHistory:
    """A request's committed token ids in a buffer whose capacity doubles when it fills:
    appending k ids costs O(k) amortised (each reallocation copies the used part once, and
    there are O(log P) of them), where re-concatenating the whole history per commit costs O(P)."""

    MIN_CAPACITY = 64

    def __init__(self, tokens: torch.Tensor):
        self._buf = tokens.detach().to("cpu", torch.int64).clone()  # [capacity] int64, the first _len used
        self._len = self._buf.numel()
        self.reallocations = 0  # times the buffer grew (a copy of the used part each)

    def __len__(self) -> int:
        return self._len

    def __repr__(self) -> str:
        return f"TokenHistory(len={self._len}, capacity={self._buf.numel()})"

    def view(self) -> torch.Tensor:
        """[len] the committed ids: a view of the buffer. Later appends never change it (they
        write past its end, or into a new buffer)."""
        return self._buf[: self._len]

    def append(self, ids: torch.Tensor) -> None:
        """Add ids (host int64, [k]) at the end; the view grows only once they are written."""
        need = self._len + ids.numel()
        if need > self._buf.numel():
            grown = torch.empty(max(need, 2 * self._buf.numel(), self.MIN_CAPACITY), dtype=torch.int64)
            grown[: self._len] = self._buf[: self._len]
            self._buf = grown
            self.reallocations += 1
        self._buf[self._len : need] = ids
        self._len = need


def accumulated_ties(counts, added: torch.Tensor) -> tuple:
    """Each request's tie count after a commit: counts[b] (a 0-d tensor, or None for none yet)
    plus added[b] ([B], on the device), in a fixed number of ops whatever B."""
    if all(c is None for c in counts):
        return added.unbind()
    if any(c is None for c in counts):
        zero = added.new_zeros(())
        counts = [zero if c is None else c for c in counts]
    return (torch.stack(list(counts)) + added).unbind()


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

    history: TokenHistory  # the P committed token ids (read them as `tokens`)
    root_token: int
    row: int
    seq_len: int = 0
    engine_id: int = 0  # the Engine that made it (its row indexes that engine's page tables)
    request_id: int = field(default_factory=lambda: next(_ids))
    # target residual streams (before hc_head) of the last rows the latest prefill/commit added
    # (at most sliding_window + 1 of them by default), positions seq_len - n .. seq_len - 1:
    # what an MTP drafter extends its sliding-window cache with
    new_hidden: torch.Tensor | None = field(default=None, repr=False)  # [n, hc_mult, hidden]
    # the output streams (mean over hc) of the engine's feature_layers at the last rows the latest
    # prefill/commit added (at most sliding_window), when a registered drafter reads them (DSpark)
    new_features: torch.Tensor | None = field(default=None, repr=False)  # [n, len(feature_layers) * hidden]
    # (committed row, C4 layer) pairs whose indexer top-k boundary was a (near-)tie, counted on
    # the model's device by prefill and commit; read it through committed_topk_ties
    ties: torch.Tensor | None = field(default=None, repr=False)  # [] int64
    released: bool = False  # set by Engine.release; a released request cannot be used again
    scratch_owner: int = field(default=0, repr=False)  # verify whose rows sit in this request's draft slots
    finalizer: object = field(default=None, repr=False, compare=False)  # returns the slots if never released

    @property
    def tokens(self) -> torch.Tensor:
        """[P] committed token ids (int64, host): a view of the request's history buffer, which
        later commits leave unchanged; clone it to edit."""
        return self.history.view()

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
