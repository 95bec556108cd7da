"""Ranks of a sharded model stay in step: the same requests, trees and acceptances everywhere.

Every rank runs the same Engine over the same batch (SPMD); only the experts, embedding and LM
head are split, and transformers' collectives hand every rank the same sums and gathers, so
the logits, and what is computed from them, agree. Two things could still differ, and a
difference would send different shapes into the next collective (a hang, not an error):

* the acceptance. Sampling draws random numbers: each rank's global RNG (or its own copy of a
  user generator) would draw differently. **Rank 0 decides every acceptance, greedy or
  sampled, and broadcasts it** (one small int64 tensor per accept call: path and bonus per
  request); the other ranks' draws are discarded. EOS and the token budget are cut from the
  emitted tokens, which are the tree's tokens on that path plus the bonus, so they agree too.
* the draft depth. An adaptive drafter decides from its own clock whether one more draft
  step pays; ranks time differently. **Rank 0 decides every step and broadcasts it** (one
  int64 per decision, `agree_choice`), so every rank runs the same number of draft passes.
* the inputs: prompts, and the trees a drafter builds from host reads of its logits. These
  are **checked, not broadcast**: one all-reduce per prefill / verify of a fingerprint (sizes
  and position-weighted sums); a mismatch raises StateError on every rank at once.

A model that is not sharded (`Model.ranks` None) skips all of this: no collective is issued."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .errors import StateError
from .verify.accept import Acceptance

_PRIME = 2**31 - 1  # terms are reduced mod this prime: each < 2^31, so int64 sums cannot overflow
_MIX = 48271  # a primitive root mod _PRIME: position weights _MIX^i differ for every index


def _weighted_sum(values: torch.Tensor) -> int:
    """sum_i (values[i] mod p) * w_i mod p, w_i = _MIX^(i+1) mod p (exact in int64)."""
    flat = torch.as_tensor(values).reshape(-1).to("cpu", torch.int64) % _PRIME
    n = flat.numel()
    w = torch.full((max(n, 1),), _MIX, dtype=torch.int64)
    k, step = 1, _MIX  # w[:k] holds _MIX^1.._MIX^k; step = _MIX^k mod p
    while k < n:  # log2(n) doublings: w[k:2k] = w[:k] * _MIX^k
        w[k : 2 * k] = w[: min(k, n - k)] * step % _PRIME
        k, step = 2 * k, step * step % _PRIME
    return int((flat * w[:n] % _PRIME).sum())


def _fingerprint(parts: list) -> torch.Tensor:
    """[2 + len(parts)] int64: count, the sizes' weighted sum, one weighted sum per part."""
    sizes = torch.tensor([torch.as_tensor(p).numel() for p in parts], dtype=torch.int64)
    return torch.tensor([len(parts), _weighted_sum(sizes)] + [_weighted_sum(p) for p in parts], dtype=torch.int64)


def check_same(model, parts: list, what: str) -> None:
    """Raise StateError on every rank when `parts` (int tensors or lists of ints) differ between
    ranks. Nothing runs (no op, no collective) when the model is not sharded."""
    if model.ranks is None:
        return
    fp = _fingerprint(parts)
    both = torch.cat([fp, -fp]).to(model.device)
    # one all-reduce: max and -min of every entry; a rank pair that differs makes them unequal
    # (if the part counts differ, the vectors differ in length and the collective itself fails)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=model.ranks)
    both = both.cpu()
    if not torch.equal(both[: fp.numel()], -both[fp.numel() :]):
        raise StateError(f"{what} differ between ranks (rank {dist.get_rank()}): every rank of a sharded model "
                         "must run the same requests and trees (same prompts, same drafter settings and seed)")


def agree_acceptances(model, trees, accs: list) -> list:
    """Rank 0's acceptances on every rank (the caller's own list when not sharded)."""
    if model.ranks is None:
        return accs
    width = 2 + max(t.num_nodes for t in trees)  # trees agree (checked at verify), so width does too
    buf = torch.full((len(accs), width), -1, dtype=torch.int64)
    for b, acc in enumerate(accs):
        buf[b, 0], buf[b, 1] = len(acc.path), acc.bonus
        buf[b, 2 : 2 + len(acc.path)] = torch.tensor(acc.path, dtype=torch.int64)
    buf = buf.to(model.device)
    dist.broadcast(buf, src=0, group=model.ranks)
    rows = buf.cpu().tolist()
    return [Acceptance(tuple(row[2 : 2 + row[0]]), row[1], acc.request_id, acc.verify_id)
            for row, acc in zip(rows, accs)]


def agree_choice(model, choice: int) -> int:
    """Rank 0's `choice` (a small int) on every rank (the caller's own when not sharded)."""
    if model.ranks is None:
        return choice
    if isinstance(choice, torch.Tensor):  # a device tensor stays one: broadcast in place, no host read
        buf = choice.reshape(1).to(model.device, torch.int64).clone()
        dist.broadcast(buf, src=0, group=model.ranks)
        return buf[0]
    buf = torch.tensor([choice], dtype=torch.int64).to(model.device)
    dist.broadcast(buf, src=0, group=model.ranks)
    return int(buf.cpu()[0])
