"""The Markov tree over one DSpark backbone pass (design_notes/dspark-trees.md).

The backbone gives every request's base logits U_1..U_gamma once; a node's children at depth k
come from softmax(U_k + W2 W1[its token]), so a node's child distribution depends only on
(request, depth, its token). Expansion is EAGLE-2's wave: at each depth the frontier is the topk
best nodes by cumulative path probability, each gives its topk children, and the candidate pool
(organize_draft_results' score_list / token_list / parents_list layout) is what the tree is cut
from. Every frontier node gets its own bias row, softmax and top-k: a fixed number of rows per
depth (B x topk), no data-dependent shape.

Alongside path probabilities the expansion keeps what node values are made of
(budget/node_values.py): each candidate's probability under its parent's distribution and each
parent's confidence c(k, t), the chance that depth k's draft survives given its parent (token t)
was accepted.

branching="base" is the DDTree-style baseline for measurements: nodes off the spine (the
chain's argmax path) branch from U_k alone, without their own Markov bias."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import ConfigError
from .dspark_rows import DSparkBlock, confidences, markov_logits

BRANCHINGS = ("markov", "base")


@dataclass
class MarkovExpansion:
    """One batched expansion: organize_draft_results' inputs, with node values alongside."""

    score_list: list  # [B, 1, K] then [B, K, K] per later depth: cumulative path probabilities
    token_list: list  # [B, K] then [B, K*K]
    parents_list: list  # [B, K+1] then [B, K] global candidate ids
    prob_list: list = field(default_factory=list)  # as score_list: each candidate's probability given its parent
    confidence_list: list = field(default_factory=list)  # [B] then [B, K]: c of each parent
    logit_list: list = field(default_factory=list)  # [B, V] then [B, K, V] fp32: each depth's parents' child logits (keep_logits)


def _children(module, base: torch.Tensor, hidden: torch.Tensor, tokens: torch.Tensor, biased, topk: int,
              temperature=None):
    """Child distributions of frontier nodes, at a fixed shape: one bias row, softmax and top-k
    per frontier node (B x F rows; no dedupe of equal tokens, whose rows would be equal anyway:
    a dedupe has a data-dependent shape, which a CUDA graph cannot hold and which reads the host).
    base [B, V] U_k, hidden [B, d] (the confidence input at depth k), both broadcast over the
    request's F nodes (no per-node copy); tokens [B, F]; biased [B, F] bool, or None: every node
    biased (branching "markov"); temperature: depth k's STS temperature (None: 1).
    -> (top-K probabilities [B, F, K], their tokens [B, F, K], logits [B, F, V] fp32, confidences [B, F])."""
    b, f = tokens.shape
    vocab = base.shape[-1]
    u = base.float().unsqueeze(1)  # [B, 1, V]
    logits = u + module.markov_bias(tokens.reshape(-1)).float().view(b, f, vocab)  # markov_logits, broadcast
    if biased is not None:
        logits = torch.where(biased.unsqueeze(2), logits, u)
    conf = confidences(module, hidden.unsqueeze(1).expand(b, f, hidden.shape[-1]), tokens, temperature)
    rows = logits.view(b * f, vocab)
    ids = rows.topk(topk, dim=-1).indices
    probs = torch.softmax(rows, -1).gather(1, ids)
    return probs.view(b, f, topk), ids.view(b, f, topk), logits, conf.view(b, f)


def expand_markov(module, blk: DSparkBlock, anchors: torch.Tensor, topk: int, num_steps: int,
                  branching: str = "markov", keep_logits: bool = False, temperatures=None) -> MarkovExpansion:
    """The wave expansion of B blocks (anchors [B] the roots' tokens) to depth num_steps <= gamma,
    topk children per frontier node and a frontier of topk nodes per depth; temperatures [gamma]:
    the confidence head's STS temperatures by depth (None: 1)."""
    temp = (lambda s: None) if temperatures is None else (lambda s: temperatures[s])  # noqa: E731
    gamma = blk.base.shape[1]
    if branching not in BRANCHINGS:
        raise ConfigError(f"branching must be one of {BRANCHINGS}, got {branching!r}")
    if not 1 <= num_steps <= gamma:
        raise ConfigError(f"num_steps={num_steps}: a DSpark tree is at most its block size {gamma} deep")
    b, k, dev = anchors.shape[0], topk, anchors.device
    pc, tc, logits, conf = _children(module, blk.base[:, 0], blk.hidden[:, 0], anchors.unsqueeze(1), None, k, temp(0))
    pc, tc, conf = pc[:, 0], tc[:, 0], conf[:, 0]  # [B, K], [B]
    out = MarkovExpansion([pc.view(b, 1, k)], [tc], [torch.arange(-1, k, device=dev).expand(b, k + 1)],
                          [pc.view(b, 1, k)], [conf])
    if keep_logits:
        out.logit_list.append(logits[:, 0])
    fscore, ftok = pc, tc
    fspine = None  # "markov": every node biased; "base": the spine's nodes only
    if branching == "base":
        fspine = torch.zeros(b, k, dtype=torch.bool, device=dev)
        fspine[:, 0] = True  # the root's rank-0 child: the chain's first draft
    for s in range(1, num_steps):
        pc, tc, logits, conf = _children(module, blk.base[:, s], blk.hidden[:, s], ftok, fspine, k, temp(s))
        scores = fscore.unsqueeze(2) * pc  # [B, K, K]
        flat = scores.reshape(b, k * k)
        out.score_list.append(scores)
        out.token_list.append(tc.reshape(b, k * k))
        out.prob_list.append(pc)
        out.confidence_list.append(conf)
        if keep_logits:
            out.logit_list.append(logits)
        chosen = torch.sort(flat, dim=1, descending=True, stable=True).indices[:, :k]
        out.parents_list.append(chosen + k * k * (s - 1) + k)
        if fspine is not None:
            fspine = fspine.gather(1, chosen // k) & (chosen % k == 0)
        fscore, ftok = flat.gather(1, chosen), tc.reshape(b, k * k).gather(1, chosen)
    return out
