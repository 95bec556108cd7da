"""Acceptance of a whole batch of trees on the device, at fixed shapes: greedy and sampled.

SGLang's rule (verify_tree_greedy, one thread per request following first-child / next-sibling
links): from the root, take the first child in sibling order (= lowest local id) whose token is
the target's argmax at the current node; the bonus is the target's argmax where the walk ends.
Here as tensor ops over [B, N]: no host read and no data-dependent shape, so a CUDA graph can
hold it; `greedy_walk` (verify/accept.py) is the per-tree host form it equals
(tests/test_accept_batch.py).

Sampled (`sample_accept`): verify/sampling.py's recursive rejection sampling of trees fixed before
any draw, for every request at once: at the current node one uniform r against the running sum
of the target's probabilities of its children in sibling order (an equal-token sibling adds
nothing), and past the sum the bonus from the remainder. Lossless like the host walk
(chi-square tests in tests/test_accept_batch.py); its uniforms are drawn all at once, so its
draws differ from the host walk's for one seed. Drawn trees (`drawn_accept`), whose nodes carry
the distributions they were drawn from, follow verify/sampling.sample_drawn the same way."""
from __future__ import annotations

import collections
from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from ..tree.build import links_from_parents


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
    tokens, parents, rows, counts = _padded(trees, out, out.run.logits.device)
    target = out.run.logits.argmax(-1)[rows]  # [B, N]
    acc = greedy_accept(tokens, parents, target, counts, max(t.max_depth for t in trees))
    return [(tuple(row[2 : 3 + row[0]]), row[1]) for row in acc.packed().tolist()]


def sample_accept(tokens: torch.Tensor, parents: torch.Tensor, probs: torch.Tensor, counts: torch.Tensor | None = None,
                  max_depth: int | None = None, generator: torch.Generator | None = None) -> BatchAcceptance:
    """tokens / parents [B, N] (padding: parent -1), probs [B, N, V] the target's distributions
    (float64, verify/sampling.target_probs), counts [B] (None: N), max_depth (None: N - 1).
    Uniforms come from `generator` on its own device (CPU by default) in one draw of
    [B, max_depth + 1, 2] and are moved to the trees' device: no host read."""
    (b, n), dev = tokens.shape, tokens.device
    ids, valid = _nodes(tokens, counts)
    dup = counted_before(tokens, parents)
    steps = n - 1 if max_depth is None else min(max_depth, n - 1)
    u, rows, cur, done, lengths, bonus = _walk_start(b, steps, 2, generator, dev)
    cols = [cur]
    for s in range(steps + 1):
        p_u = probs[rows, cur]  # [B, V]
        child = valid & (parents == cur.unsqueeze(1))  # [B, c]
        has = child.any(1)
        pc = p_u.gather(1, tokens)  # [B, c]
        cum = torch.cumsum(torch.where(child & ~dup, pc, torch.zeros_like(pc)), 1)
        hit = child & (u[:, s, 0].unsqueeze(1) < cum)
        first = torch.where(hit, ids, n).amin(1)
        removed = torch.zeros_like(p_u).scatter_add_(1, tokens, child.to(p_u.dtype)) > 0  # the children's tokens
        residual = torch.where(removed, torch.zeros_like(p_u), p_u)
        # rounding left r just past a sum that is 1: the last child with mass is the pick
        spent = has & (first == n) & (residual.sum(1) <= 0)
        last = torch.where(child & (pc > 0), ids, -1).amax(1)
        first = torch.where(spent & (last >= 0), last, first)
        chose = (first < n) & ~done
        stop = ~done & ~chose
        # the bonus where the walk stops: the remainder (children's tokens removed), or the row itself
        dist = torch.where(has.unsqueeze(1), residual, p_u)
        cdf = torch.cumsum(dist, 1)
        drawn = torch.searchsorted(cdf, (u[:, s, 1] * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
        bonus = torch.where(stop, drawn.clamp(max=dist.shape[1] - 1), bonus)
        done = done | stop
        if s < steps:
            cur = torch.where(chose, first, cur)
            lengths = lengths + chose.long()
            cols.append(torch.where(chose, first, -1))
    # a walk still going after max_depth steps stops at a leaf: its bonus was drawn at the last step
    return BatchAcceptance(lengths, torch.stack(cols, 1), bonus)


def _nodes(tokens: torch.Tensor, counts) -> tuple:
    """(node ids [N], valid [B, N]: a non-root node within its row's count)."""
    ids = torch.arange(tokens.shape[1], device=tokens.device)
    valid = ids.unsqueeze(0) >= 1
    return ids, valid if counts is None else valid & (ids.unsqueeze(0) < counts.unsqueeze(1))


def _walk_start(b: int, steps: int, width: int, generator, dev) -> tuple:
    """A sampled walk's start: uniforms [B, steps + 1, width] drawn at once from `generator` on its
    own device (CPU by default) and moved to dev; row ids; the current node, done, lengths and
    bonus per row."""
    gen_dev = generator.device if generator is not None else torch.device("cpu")
    u = torch.rand(b, steps + 1, width, generator=generator, dtype=torch.float64, device=gen_dev).to(dev)
    zeros = torch.zeros(b, dtype=torch.int64, device=dev)
    return u, torch.arange(b, device=dev), zeros, zeros.bool(), zeros.clone(), zeros.clone()


def counted_before(tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """[B, N] bool: node c has an earlier sibling with its token (its mass is already counted)."""
    n = tokens.shape[1]
    ids = torch.arange(n, device=tokens.device)
    same = (parents.unsqueeze(2) == parents.unsqueeze(1)) & (tokens.unsqueeze(2) == tokens.unsqueeze(1))
    return (same & (ids.view(1, 1, n) < ids.view(1, n, 1))).any(-1)


def device_sample(trees: list, out, temperature: float, top_p: float, generator) -> list:
    """Engine.accept_sampling for DraftTree.made trees (no draw distributions): [(path, bonus)]
    per tree from sample_accept and one host read of its result."""
    from .sampling import target_probs

    logits = out.run.logits
    dev = logits.device
    tokens, parents, rows, counts = _padded(trees, out, dev)
    probs = target_probs(logits, temperature, top_p)[rows]  # [B, N, V] float64
    acc = sample_accept(tokens, parents, probs, counts, max(t.max_depth for t in trees), generator)
    return [(tuple(row[2 : 3 + row[0]]), row[1]) for row in acc.packed().tolist()]


def drawn_accept(tokens: torch.Tensor, parents: torch.Tensor, probs: torch.Tensor, q: torch.Tensor,
                 counts: torch.Tensor | None = None, max_depth: int | None = None, slots: int | None = None,
                 generator: torch.Generator | None = None) -> BatchAcceptance:
    """verify/sampling.sample_drawn for a batch of drawn trees: tokens / parents [B, N] (padding:
    parent -1), probs [B, N, V] the target's distributions (float64), q [B, N, V] node i's draw
    distribution at row i (row 0 unused; a chosen node's row one-hot), counts [B] (None: N),
    max_depth (None: N - 1), slots: the most children a node has (None: N - 1), the inner loop's
    fixed length. Uniforms: one draw of [B, max_depth + 1, slots + 1] from `generator` on its
    device, moved to the trees' device: no host read."""
    (b, n), dev = tokens.shape, tokens.device
    _, valid = _nodes(tokens, counts)
    steps = n - 1 if max_depth is None else min(max_depth, n - 1)
    slots = n - 1 if slots is None else max(1, min(slots, n - 1))
    first, nxt = links_from_parents(torch.where(valid, parents, -1))  # children in id order, -1: none
    u, rows, cur, done, lengths, bonus = _walk_start(b, steps, slots + 1, generator, dev)
    cols = [cur]
    for s in range(steps + 1):
        residual = probs[rows, cur]  # [B, V]
        chosen = torch.full((b,), n, dtype=torch.int64, device=dev)
        c = first[rows, cur]
        for j in range(slots):
            live = (c >= 0) & (chosen == n) & ~done
            cc = c.clamp(min=0)
            t = tokens[rows, cc].unsqueeze(1)
            qc = q[rows, cc]  # [B, V]
            accept = live & (u[:, s, j] * qc.gather(1, t).squeeze(1) < residual.gather(1, t).squeeze(1))
            chosen = torch.where(accept, c, chosen)
            rest = (residual - qc).clamp(min=0)
            mass = rest.sum(1, keepdim=True)
            # a rejection replaces the residual; mass 0 (residual == q up to rounding) had probability 0
            swap = (live & ~accept).unsqueeze(1) & (mass > 0)
            residual = torch.where(swap, rest / mass.clamp(min=torch.finfo(rest.dtype).tiny), residual)
            c = torch.where(c >= 0, nxt[rows, cc], c)
        stop = ~done & (chosen == n)
        cdf = torch.cumsum(residual, 1)
        drawn = torch.searchsorted(cdf, (u[:, s, slots] * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
        bonus = torch.where(stop, drawn.clamp(max=residual.shape[1] - 1), bonus)
        done = done | stop
        if s < steps:
            go = chosen < n
            cur = torch.where(go, chosen, cur)
            lengths = lengths + go.long()
            cols.append(torch.where(go, chosen, -1))
    return BatchAcceptance(lengths, torch.stack(cols, 1), bonus)


def device_drawn(trees: list, out, temperature: float, top_p: float, generator) -> list:
    """Engine.accept_sampling for made drawn trees (draft_probs on the drafter's device):
    [(path, bonus)] per tree from drawn_accept and one host read of its result."""
    from .sampling import target_probs

    logits = out.run.logits
    dev = logits.device
    tokens, parents, rows, counts = _padded(trees, out, dev)
    probs = target_probs(logits, temperature, top_p)[rows]  # [B, N, V] float64
    rows_q = pad_sequence([t.draft_probs.to(dev, torch.float64) for t in trees], batch_first=True)  # [B, N - 1, V]
    q = torch.cat([rows_q.new_zeros(len(trees), 1, rows_q.shape[2]), rows_q], 1)  # row 0: the root's, unused
    slots = max(max(collections.Counter(t.host_lists()[1][1:]).values(), default=1) for t in trees)
    acc = drawn_accept(tokens, parents, probs, q, counts, max(t.max_depth for t in trees), slots, generator)
    return [(tuple(row[2 : 3 + row[0]]), row[1]) for row in acc.packed().tolist()]


def _padded(trees: list, out, dev) -> tuple:
    """The made trees' host lists as [B, N] tensors on dev (one copy each), the run's row of
    every node (padding: the tree's last node) and the node counts."""
    n = max(t.num_nodes for t in trees)
    pad = lambda xs, fill: xs + [fill] * (n - len(xs))  # noqa: E731
    tokens = torch.tensor([pad(t.host_lists()[0], 0) for t in trees]).to(dev)
    parents = torch.tensor([pad(t.host_lists()[1], -1) for t in trees]).to(dev)
    rows = torch.tensor([[o + min(i, c - 1) for i in range(n)]
                         for o, c in zip(out.plan.offsets, out.plan.num_nodes)]).to(dev)
    counts = torch.tensor([t.num_nodes for t in trees]).to(dev)
    return tokens, parents, rows, counts
