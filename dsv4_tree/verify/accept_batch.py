"""Greedy acceptance of a whole batch of trees on the device, at fixed shapes.

SGLang's rule (verify_tree_greedy, one thread per request following first-child / next-sibling
links): from the root, take the first child in sibling order (= lowest local id) whose token is
the target's argmax at the current node; the bonus is the target's argmax where the walk ends.
Here as tensor ops over [B, N]: no host read and no data-dependent shape, so a CUDA graph can
hold it; `greedy_walk` (verify/accept.py) is the per-tree host form it equals
(tests/test_accept_batch.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BatchAcceptance:
    """lengths [B]: accepted draft nodes (root excluded); path [B, D + 1]: node ids root first,
    -1 past each row's length; bonus [B]: the target's token after the path. int64, on the device."""

    lengths: torch.Tensor
    path: torch.Tensor
    bonus: torch.Tensor

    def packed(self) -> torch.Tensor:
        """[B, D + 3]: lengths, bonus, path: what the round reads on the host, in one copy."""
        return torch.cat([self.lengths.unsqueeze(1), self.bonus.unsqueeze(1), self.path], 1)


def greedy_accept(tokens: torch.Tensor, parents: torch.Tensor, target: torch.Tensor, counts: torch.Tensor | None = None,
                  max_depth: int | None = None) -> BatchAcceptance:
    """tokens / parents [B, N] (a TreeBatch's: padding has parent -1), target [B, N] the target's
    argmax at every node, counts [B] nodes per row (None: N), max_depth: a bound on every tree's
    depth (None: N - 1), the walk's fixed number of steps."""
    b, n = tokens.shape
    dev = tokens.device
    ids = torch.arange(n, device=dev)
    valid = ids.unsqueeze(0) >= 1 if counts is None else (ids.unsqueeze(0) >= 1) & (ids.unsqueeze(0) < counts.unsqueeze(1))
    parent_target = target.gather(1, parents.clamp(min=0))
    match = valid & (parents >= 0) & (tokens == parent_target)  # [B, N]: node i is its parent's argmax
    # first matching child of every node u: the lowest id i with parents[i] == u and match[i]
    child_of = (parents.unsqueeze(1) == ids.view(1, n, 1)) & match.unsqueeze(1)  # [B, u, i]
    first = torch.where(child_of, ids.view(1, 1, n), n).amin(-1)  # [B, N], n: none
    steps = n - 1 if max_depth is None else min(max_depth, n - 1)
    cur = torch.zeros(b, dtype=torch.int64, device=dev)
    lengths = torch.zeros(b, dtype=torch.int64, device=dev)
    cols = [cur]
    for _ in range(steps):
        nxt = first.gather(1, cur.unsqueeze(1)).squeeze(1)
        live = nxt < n
        cur = torch.where(live, nxt, cur)
        lengths = lengths + live.long()
        cols.append(torch.where(live, nxt, -1))
    path = torch.stack(cols, 1)
    # a column after a dead one stays dead (first[cur] repeats the stop): mask by length
    path = torch.where(torch.arange(steps + 1, device=dev).unsqueeze(0) <= lengths.unsqueeze(1), path, -1)
    bonus = target.gather(1, cur.unsqueeze(1)).squeeze(1)
    return BatchAcceptance(lengths, path, bonus)


def device_greedy(trees: list, out) -> list:
    """Engine.accept_greedy for DraftTree.made trees: [(path tuple, bonus)] per tree, from
    greedy_accept over the batch padded to its largest tree and one host read of its result."""
    logits = out.run.logits
    dev = logits.device
    n = max(t.num_nodes for t in trees)
    pad = lambda xs, fill: xs + [fill] * (n - len(xs))  # noqa: E731
    tokens = torch.tensor([pad(t.host_lists()[0], 0) for t in trees]).to(dev)
    parents = torch.tensor([pad(t.host_lists()[1], -1) for t in trees]).to(dev)
    rows = torch.tensor([[o + min(i, c - 1) for i in range(n)]
                         for o, c in zip(out.plan.offsets, out.plan.num_nodes)]).to(dev)  # padding: the last node's
    target = logits.argmax(-1)[rows]  # [B, N]
    counts = torch.tensor([t.num_nodes for t in trees]).to(dev)
    acc = greedy_accept(tokens, parents, target, counts, max(t.max_depth for t in trees))
    return [(tuple(row[2 : 3 + row[0]]), row[1]) for row in acc.packed().tolist()]
