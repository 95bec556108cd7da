"""Greedy tree acceptance with SGLang's traversal semantics (verify_tree_greedy), batched."""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..errors import TreeError


class GreedyResult(NamedTuple):
    predicts: torch.Tensor  # [bs*N] next accepted token along the path, bonus at the last node
    accept_index: torch.Tensor  # [bs, num_speculative_tokens] global row ids, root first, -1 padded
    accept_token_num: torch.Tensor  # [bs] accepted draft tokens (root excluded)


def parents_from_links(next_token: torch.Tensor, next_sibling: torch.Tensor) -> torch.Tensor:
    """Invert (first child, next sibling) links into a [bs, N] parent vector (root -1).

    Pointer jumping over sibling links, so log2(N) tensor steps; malformed links (out of
    range, cycles, nodes reachable twice or never) raise TreeError."""
    bs, n = next_token.shape
    for name, t in (("retrieve_next_token", next_token), ("retrieve_next_sibling", next_sibling)):
        if ((t < -1) | (t >= n)).any():
            raise TreeError(f"{name} holds ids outside [-1, {n - 1}]")
    rows = torch.arange(bs, device=next_token.device).unsqueeze(1).expand(bs, n)
    ids = torch.arange(n, device=next_token.device).expand(bs, n)
    # each node must be named at most once as a first child or a next sibling
    named = torch.zeros(bs, n, dtype=torch.long, device=next_token.device)
    for links in (next_token, next_sibling):
        ok = links >= 0
        named.index_put_((rows[ok], links[ok]), torch.ones_like(links[ok]), accumulate=True)
    if (named > 1).any() or (named[:, 0] > 0).any():
        raise TreeError("tree links name a node twice, or name the root as a child")
    if (named[:, 1:] == 0).any():
        raise TreeError("a non-root node is reachable from no first-child or next-sibling link")
    prev = ids.clone()  # previous sibling, self for first children
    ok = next_sibling >= 0
    prev[rows[ok], next_sibling[ok]] = ids[ok]
    for _ in range(max(1, n.bit_length())):
        prev = torch.gather(prev, 1, prev)
    first = prev  # first child of each node's sibling group
    parent_of_first = torch.full((bs, n), -1, dtype=torch.long, device=next_token.device)
    ok = next_token >= 0
    parent_of_first[rows[ok], next_token[ok]] = ids[ok]
    parents = torch.gather(parent_of_first, 1, first)
    parents[:, 0] = -1
    if (parents[:, 1:] < 0).any() or (parents[:, 1:] >= ids[:, 1:]).any():
        raise TreeError("tree links do not form a tree whose parents precede their children")
    return parents


def verify_tree_greedy(
    candidates: torch.Tensor,
    retrieve_index: torch.Tensor,
    retrieve_next_token: torch.Tensor,
    retrieve_next_sibling: torch.Tensor,
    target_predict: torch.Tensor,
    num_speculative_tokens: int,
    predicts: torch.Tensor | None = None,
) -> GreedyResult:
    """From the root, take the first child (sibling order) whose token equals the target's
    argmax at the current node; stop at no match or after num_speculative_tokens - 1 steps.

    candidates: [bs, N] node tokens; target_predict: [bs*N] or [bs, N] argmax per row."""
    if candidates.dim() != 2:
        raise TreeError(f"candidates must be [bs, N], got shape {tuple(candidates.shape)}")
    bs, n = candidates.shape
    for name, t in (
        ("retrieve_index", retrieve_index),
        ("retrieve_next_token", retrieve_next_token),
        ("retrieve_next_sibling", retrieve_next_sibling),
    ):
        if t.shape != (bs, n):
            raise TreeError(f"{name} must be (bs={bs}, N={n}), got {tuple(t.shape)}")
    if target_predict.numel() != bs * n:
        raise TreeError(f"target_predict must hold bs*N={bs * n} entries, got {target_predict.numel()}")
    if num_speculative_tokens < 1:
        raise TreeError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
    target = target_predict.reshape(bs, n).long()
    parents = parents_from_links(retrieve_next_token.long(), retrieve_next_sibling.long())
    # a child matches when its token is the target's choice at its parent; the accepted child
    # of u is the first matching child in sibling order = the smallest matching local id
    par = parents.clamp(min=0)
    match = (candidates.long() == torch.gather(target, 1, par)) & (parents >= 0)
    ids = torch.arange(n, device=candidates.device).expand(bs, n)
    big = torch.full((bs, n), n, dtype=torch.long, device=candidates.device)
    accepted_child = big.scatter_reduce(1, par, torch.where(match, ids, big), reduce="amin")
    accept_index = torch.full((bs, num_speculative_tokens), -1, dtype=torch.long, device=candidates.device)
    cur = torch.zeros(bs, dtype=torch.long, device=candidates.device)
    alive = torch.ones(bs, dtype=torch.bool, device=candidates.device)
    accept_index[:, 0] = retrieve_index[:, 0]
    num = torch.zeros(bs, dtype=torch.long, device=candidates.device)
    out = torch.zeros(bs * n, dtype=target.dtype, device=candidates.device) if predicts is None else predicts
    brow = torch.arange(bs, device=candidates.device)
    for step in range(1, num_speculative_tokens):
        nxt = accepted_child[brow, cur]
        step_ok = alive & (nxt < n)
        if not step_ok.any():
            break
        nxt_safe = torch.where(step_ok, nxt, cur)
        # along the path, a node's entry is the next accepted token
        sel = step_ok.nonzero().flatten()
        out[retrieve_index[sel, cur[sel]]] = candidates[sel, nxt_safe[sel]].to(out.dtype)
        accept_index[sel, step] = retrieve_index[sel, nxt_safe[sel]]
        num = num + step_ok.long()
        cur = nxt_safe
        alive = step_ok
    out[retrieve_index[brow, cur]] = target[brow, cur].to(out.dtype)
    return GreedyResult(out, accept_index, num)
