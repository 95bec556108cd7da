"""Drawn DSpark trees: what a sampling run drafts with eagle_topk = K > 1 (design_notes/dspark-trees.md).

The sampled chain's drawn spine, with chosen tokens beside each spine node:

    depth k (parent: the spine node at depth k - 1, or the root):
        spine     x_k drawn from q_k, the parent's Markov-biased draft distribution (temperature
                  and top-p applied), exactly as the sampled chain draws it: its row is q_k
        siblings  the top s_k tokens of q_k other than x_k, chosen, not drawn: one-hot rows

Node ids run depth by depth, the spine node before its siblings, so verify tries the drawn token
first, against q_k, as the chain would, and the chosen ones only after it was rejected, each
against what is left of the target (verify/sampling.sample_drawn). Every path the chain accepts
the tree accepts too; where the chain stops at a rejection, the tree also accepts a sibling
whose token takes the residual max(p - q, 0): the tree's tokens per verify are at least the
chain's, never less, for any p and q.

Why it stays lossless: every node is drawn (or chosen) from its row given only nodes with lower
ids (its parent's path, and for a sibling the spine token and siblings before it). The shape
never depends on a draw it precedes: the sibling counts come from the config (`sibling_counts`),
an adaptive spine length follows the chain's rule (budget_policy.chain_fixed: a spine node's
inclusion depends on the drafts before it only). Siblings come after their depth's spine node,
so which of them an adaptive run keeps may read that spine token and everything under it (what
lies under it matters only when it is accepted, and then the siblings are never tried): it
keeps those worth at least the chain budget's last spine node (`node_values`: this round's
survivals, and each sibling rank's acceptance learnt from past rounds), at depths the spine
reaches. tests/test_drawn_trees.py shows both sides: siblings
kept by a later draw stay lossless, a spine node kept by its own draw does not.

Draws use uniforms drawn at once from the run's generator on its own device (`draw_uniforms`),
inverted on the model's device (no host read, no data-dependent shape): a captured draft takes
them as an input (drafters/dspark_graphs.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..budget.verify_budget import marginal_value
from ..verify.sampling import target_probs
from .dspark_budget import batch_of
from .dspark_rows import DSparkBlock, confidences, markov_logits


def sibling_counts(topk: int, num_steps: int, num_nodes: int) -> list:
    """Chosen siblings beside each depth's spine node: the spine is min(num_steps, num_nodes - 1)
    deep; the nodes left over go to the shallowest depths first, at most topk - 1 each."""
    spine = max(0, min(num_steps, num_nodes - 1))
    left = num_nodes - 1 - spine
    out = []
    for _ in range(spine):
        s = min(topk - 1, left)
        out.append(s)
        left -= s
    return out


def drawn_parents(counts: list) -> list:
    """The drawn tree's parent list: depth k's spine node, then its siblings, all children of
    depth k - 1's spine node (the root at depth 1)."""
    parents, spine = [-1], 0
    for s in counts:
        parents += [spine] * (s + 1)
        spine = len(parents) - 1 - s
    return parents


@dataclass
class DrawnTree:
    """A batch's drawn trees: every row has the same shape (counts, parents)."""

    tokens: torch.Tensor  # [B, N] int64, node 0 the anchor
    parents: list  # [N] the shared parent list
    counts: list  # siblings per depth
    draw_probs: torch.Tensor  # [B, N - 1, V] float64: node i + 1's draw distribution
    spine: torch.Tensor  # [B, D + 1] the anchor, then the spine's tokens
    logits: torch.Tensor  # [B, D, V] fp32: depth k's Markov-biased logits (its parent's)


def draw_uniforms(generator, rows: int, depths: int, device) -> torch.Tensor:
    """[rows, depths] float64 on `device`: the uniforms of a batch's drawn spines, drawn at once
    from `generator` on its own device (None: the global CPU generator), depth-major: depth k's
    rows draws, then depth k + 1's, the order a depth-by-depth walk would take them."""
    gen_dev = generator.device if generator is not None else torch.device("cpu")
    u = torch.rand(depths, rows, generator=generator, dtype=torch.float64, device=gen_dev)
    return u.to(device).t().contiguous()


def _draw(dist: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of dist [B, V] (rows sum to 1) by inverting the CDF at the uniforms u
    [B]: no host read."""
    cdf = torch.cumsum(dist, 1)
    return torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1).clamp(max=dist.shape[1] - 1)


def _others(q: torch.Tensor, x: torch.Tensor, s: int) -> torch.Tensor:
    """The top s tokens of each row of q [B, V] other than x [B]: [B, s], best first."""
    top = q.topk(s + 1, dim=1).indices  # [B, s + 1]
    ar = torch.arange(s + 1, device=q.device)
    hit = top == x.unsqueeze(1)
    drop = torch.where(hit.any(1), hit.long().argmax(1), s)  # x's place, else the last
    keep = torch.argsort((ar == drop.unsqueeze(1)).long(), dim=1, stable=True)[:, :s]  # fixed shape: no mask read
    return top.gather(1, keep)


def draw_tree(module, blk: DSparkBlock, anchors: torch.Tensor, topk: int, num_steps: int, num_nodes: int,
              temperature: float, top_p: float, uniforms: torch.Tensor) -> DrawnTree:
    """The drawn trees of a batch (module docstring); uniforms [B, D] (draw_uniforms, D the
    spine's depth): column k inverts depth k's draws."""
    counts = sibling_counts(topk, num_steps, num_nodes)
    prev, cols, rows, spine, logits = anchors, [anchors.unsqueeze(1)], [], [anchors], []
    for k, s in enumerate(counts):
        lk = markov_logits(module, blk.base[:, k], prev)  # [B, V] fp32
        q = target_probs(lk, temperature, top_p)  # [B, V] float64
        prev = _draw(q, uniforms[:, k])
        cols.append(prev.unsqueeze(1))
        rows.append(q.unsqueeze(1))
        if s:
            sib = _others(q, prev, s)
            cols.append(sib)
            rows.append(torch.zeros(q.shape[0], s, q.shape[1], dtype=q.dtype, device=q.device).scatter_(
                2, sib.unsqueeze(2), 1.0))
        spine.append(prev)
        logits.append(lk)
    b, vocab = anchors.shape[0], blk.base.shape[-1]
    return DrawnTree(torch.cat(cols, 1), drawn_parents(counts), counts,
                     torch.cat(rows, 1) if rows else torch.zeros(b, 0, vocab, dtype=torch.float64, device=anchors.device),
                     torch.stack(spine, 1),
                     torch.stack(logits, 1) if logits else torch.zeros(b, 0, vocab, device=anchors.device))


_LAYOUTS: dict = {}


def _layout(counts: list, device) -> tuple:
    """(depth - 1, rank, pool parent, node parent) of a drawn shape as tensors on `device`, made
    once per (shape, device): a captured draft reads them, no host-to-device copy per round."""
    key = (tuple(counts), str(torch.device(device) if device is not None else "cpu"))
    if key not in _LAYOUTS:
        depth = [k for k, s in enumerate(counts) for _ in range(s + 1)]
        rank = [j for s in counts for j in range(s + 1)]
        parents = drawn_parents(counts)
        with torch.inference_mode(False):  # ordinary tensors, usable outside inference mode too
            _LAYOUTS[key] = tuple(torch.tensor(x, dtype=torch.int64, device=device)
                                  for x in (depth, rank, [p - 1 for p in parents[1:]], parents))
    return _LAYOUTS[key]


def node_layout(counts: list, device=None) -> tuple:
    """Each non-root node's (depth - 1, rank: 0 the spine node, j the j-th sibling), [N - 1] each."""
    return _layout(counts, device)[:2]


def drawn_parent_rows(counts: list, rows: int, device) -> torch.Tensor:
    """[rows, N] the drawn shape's parent list for every request (a TreeBatch's parents)."""
    return _layout(counts, device)[3].expand(rows, -1)


def node_values(drawn: DrawnTree, confidence: torch.Tensor, rates: torch.Tensor) -> torch.Tensor:
    """[B, N - 1] float64: the chance the accepted path takes each node. confidence [B, D]: c_k,
    the chance depth k's spine draft survives given its parent was accepted (the confidence
    head); rates [K - 1]: a rank-j sibling's acceptance once tried (budget/sibling_rate.py,
    past rounds). A spine node at depth k: S_k = c_1 ... c_k; its rank-j sibling:
    S_(k-1) (1 - c_k) (1 - rate_0) ... (1 - rate_(j-1)) rate_j."""
    conf = confidence.to(torch.float64)
    surv = torch.cumprod(conf, 1)
    before = torch.cat([torch.ones_like(surv[:, :1]), surv[:, :-1]], 1)  # S_(k-1)
    rates = rates.to(conf.device, torch.float64)
    one = torch.ones(1, dtype=torch.float64, device=conf.device)
    reach = torch.cat([one, torch.cumprod(1 - rates, 0)])  # [K]: tried, given the spine rejected
    sib = torch.cat([one, reach[:-1] * rates])  # rank 0 slot unused (the spine)
    d, r = node_layout(drawn.counts, conf.device)
    return torch.where(r == 0, surv[:, d], before[:, d] * (1 - conf[:, d]) * sib[r])


def pool_parents(drawn: DrawnTree) -> list:
    """Each non-root node's parent as a pool id (node id - 1; -1: the root): dspark_budget.batch_of's layout."""
    return [p - 1 for p in drawn.parents[1:]]


def budget_select(drawn: DrawnTree, conf: torch.Tensor, lens: torch.Tensor, budget, rates: torch.Tensor,
                  anchors: torch.Tensor) -> tuple:
    """An adaptive drawn tree: the spine's first lens - 1 nodes (lens [B], the chain budget's
    verify lengths), and beside them the siblings worth at least `budget`'s last spine node
    (marginal_value of conf [B, D]; rates: sibling_rate's). -> (TreeBatch [B, N] with node
    counts, each node's draw row [B, N - 1, V]); fixed shapes, on the device."""
    b, dev = anchors.shape[0], anchors.device
    price = marginal_value(conf, budget)
    depth, rank, pool_par = _layout(drawn.counts, dev)[:3]
    values = node_values(drawn, conf, rates)
    keep = (depth.unsqueeze(0) < (lens - 1).unsqueeze(1)) & ((rank == 0) | (values >= price))
    batch, sel = batch_of(anchors, drawn.tokens[:, 1:], pool_par.expand(b, -1), keep, keep.shape[1])
    rows = drawn.draw_probs.gather(1, sel.unsqueeze(2).expand(-1, -1, drawn.draw_probs.shape[2]))
    return batch, rows


def spine_confidences(module, blk: DSparkBlock, drawn: DrawnTree, temperatures=None) -> torch.Tensor:
    """[B, D]: the confidence head at each spine depth, from the token before it (what an
    adaptive chain's length is scheduled from)."""
    d = drawn.spine.shape[1] - 1
    return confidences(module, blk.hidden[:, :d], drawn.spine[:, :-1],
                       None if temperatures is None else temperatures[:d])
