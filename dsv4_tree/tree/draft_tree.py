"""DraftTree: one request's verify tree (node 0 = root, parents before children)."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..errors import TreeError


def depth_by_pointer_jumping(parents: torch.Tensor) -> torch.Tensor:
    """Depth of every node from a parent vector ([..., N], -1 at roots), in log2(N) steps.

    Works on a batch: the last dimension holds local node ids."""
    ptr = parents.clamp(min=0)
    depth = (parents >= 0).long()
    n = parents.shape[-1]
    for _ in range(max(1, (n - 1).bit_length())):
        depth = depth + torch.gather(depth, -1, ptr)
        ptr = torch.gather(ptr, -1, ptr)
    return depth


def ancestor_matrix(parents: torch.Tensor) -> torch.Tensor:
    """anc[..., i, j] is True when node j lies on path(i) (ancestor or self). [..., N, N]"""
    n = parents.shape[-1]
    eye = torch.eye(n, dtype=torch.bool, device=parents.device).expand(*parents.shape[:-1], n, n)
    step = torch.zeros_like(eye)
    step = step | (parents.unsqueeze(-1) == torch.arange(n, device=parents.device))
    reach = (eye | step).float()
    for _ in range(max(1, (n - 1).bit_length())):
        reach = ((reach @ reach) > 0).float()
    return reach > 0


@dataclass(frozen=True)
class DraftTree:
    """A verify tree: `tokens[i]` is node i's token, `parents[i] < i` its parent, node 0 the root.

    tokens:  [N] int64
    parents: [N] int64, parents[0] == -1
    draft_probs: None, or [N - 1, V] for a tree whose tokens were drawn at random: row i is the
    distribution node i + 1's token was drawn from, given the tree's nodes before it (a node
    chosen, not drawn, has a one-hot row). Verify's rejection sampling tries each node's children
    in id order against these rows (verify/sampling.py); a sampled chain is the one-child case.
    Derived on first use (cached): depth [N], path [N, max_depth+1] (ancestor of node i at each
    depth, -1 past its depth), ancestors [N, N] bool, leaves [L]. Construction only validates
    (O(N)); nothing quadratic is built unless asked for, so a prefill chunk's chain is linear.
    """

    tokens: torch.Tensor  # [N] int64
    parents: torch.Tensor  # [N] int64
    draft_probs: torch.Tensor | None = None  # [N - 1, V] float, a drawn tree's draw distributions

    def __post_init__(self) -> None:
        tokens, parents = self.tokens, self.parents
        for name, t in (("tokens", tokens), ("parents", parents)):
            if not isinstance(t, torch.Tensor):
                raise TreeError(f"DraftTree.{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype != torch.int64:
                raise TreeError(f"DraftTree.{name} must be int64, got {t.dtype}")
            if t.dim() != 1:
                raise TreeError(f"DraftTree.{name} must be 1-D, got shape {tuple(t.shape)}")
        if tokens.numel() == 0:
            raise TreeError("DraftTree needs at least one node (the root)")
        if tokens.shape != parents.shape:
            raise TreeError(f"DraftTree tokens {tuple(tokens.shape)} and parents {tuple(parents.shape)} differ")
        if tokens.device != parents.device:
            raise TreeError(f"DraftTree tokens on {tokens.device}, parents on {parents.device}")
        # own copies: a frozen tree must not change when the caller edits the tensors it passed
        tokens, parents = tokens.detach().to("cpu", copy=True), parents.detach().to("cpu", copy=True)
        if int(parents[0]) != -1:
            raise TreeError(f"DraftTree.parents[0] must be -1 (node 0 is the root), got {int(parents[0])}")
        idx = torch.arange(tokens.numel())
        bad = ((parents[1:] < 0) | (parents[1:] >= idx[1:])).nonzero()
        if bad.numel():
            i = int(bad[0, 0]) + 1
            raise TreeError(
                f"DraftTree.parents[{i}]={int(parents[i])}: every non-root node needs 0 <= parent < its index"
            )
        if (tokens < 0).any():
            i = int((tokens < 0).nonzero()[0, 0])
            raise TreeError(f"DraftTree.tokens[{i}]={int(tokens[i])} is negative")
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "parents", parents)
        if self.draft_probs is not None:
            object.__setattr__(self, "draft_probs", _checked_probs(self.draft_probs, tokens, parents))

    @classmethod
    def made(cls, tokens: list, parents: list, draft_probs: torch.Tensor | None = None) -> "DraftTree":
        """A tree the engine's own drafting built, from host lists (a row of the draft's one
        host read, tree/tree_batch.py): not re-checked (a drafter makes parents before children,
        token ids from the vocabulary), and it keeps the lists, so reading its structure on the
        host (acceptance, commit, the engine's limits) costs no further read. draft_probs: a drawn
        tree's rows [N - 1, V], kept where the drafter made them (on its device)."""
        tree = object.__new__(cls)
        with torch.inference_mode(False):  # trees are the caller's: ordinary tensors
            object.__setattr__(tree, "tokens", torch.tensor(tokens, dtype=torch.int64))
            object.__setattr__(tree, "parents", torch.tensor(parents, dtype=torch.int64))
        object.__setattr__(tree, "draft_probs", draft_probs)
        tree.__dict__["_lists"] = (list(tokens), list(parents))
        tree.__dict__["_made"] = True
        return tree

    @property
    def is_made(self) -> bool:
        """Built by DraftTree.made (the engine's own draft), not by a caller."""
        return self.__dict__.get("_made", False)

    def host_lists(self) -> tuple:
        """(tokens, parents) as Python lists: a made tree's own, any other tree's read once."""
        lists = self.__dict__.get("_lists")
        if lists is None:
            lists = (self.tokens.tolist(), self.parents.tolist())
            self.__dict__["_lists"] = lists
        return lists

    @functools.cached_property
    def host_depths(self) -> list:
        """Depth of every node as Python ints, from host_lists (parents come first)."""
        depth = [0]
        for p in self.host_lists()[1][1:]:
            depth.append(depth[p] + 1)
        return depth

    @functools.cached_property
    def _chain(self) -> bool:
        if "_lists" in self.__dict__:
            return all(p == i - 1 for i, p in enumerate(self.host_lists()[1]))
        return bool((self.parents == torch.arange(self.num_nodes) - 1).all())

    @functools.cached_property
    def depth(self) -> torch.Tensor:
        """Depth of every node. [N] int64"""
        if self._chain:
            return torch.arange(self.num_nodes)
        return depth_by_pointer_jumping(self.parents)

    @functools.cached_property
    def path(self) -> torch.Tensor:
        """path[i, d]: node i's ancestor at depth d (i itself at depth(i)), -1 past it. [N, D+1]"""
        n, d = self.num_nodes, self.max_depth
        if self._chain:
            cols = torch.arange(n)
            return torch.where(cols.unsqueeze(0) <= cols.unsqueeze(1), cols.unsqueeze(0), -1)
        path = torch.full((n, d + 1), -1, dtype=torch.int64)
        rows, cur = torch.arange(n), torch.arange(n)
        for _ in range(d + 1):  # one vectorised step per level: O(N * D), the size of the output
            live = cur >= 0
            path[rows[live], self.depth[cur[live]]] = cur[live]
            cur = torch.where(live, self.parents[cur.clamp(min=0)], cur)
        return path

    @functools.cached_property
    def ancestors(self) -> torch.Tensor:
        """ancestors[i, j]: node j lies on path(i) (ancestor or self). [N, N] bool"""
        cols = torch.arange(self.num_nodes)
        return self.path[:, self.depth] == cols.unsqueeze(0)

    @functools.cached_property
    def leaves(self) -> torch.Tensor:
        """Nodes without children, ascending. [L] int64"""
        if self._chain:
            return torch.tensor([self.num_nodes - 1])
        children = torch.bincount(self.parents[1:], minlength=self.num_nodes)
        return (children == 0).nonzero().flatten()

    @classmethod
    def from_lists(cls, tokens, parents) -> "DraftTree":
        return cls(torch.as_tensor(tokens, dtype=torch.int64), torch.as_tensor(parents, dtype=torch.int64))

    @classmethod
    def chain(cls, tokens) -> "DraftTree":
        """A chain: node i's parent is i - 1."""
        tokens = torch.as_tensor(tokens, dtype=torch.int64)
        return cls(tokens, torch.arange(tokens.numel(), dtype=torch.int64) - 1)

    @property
    def num_nodes(self) -> int:
        return self.tokens.numel()

    @property
    def max_depth(self) -> int:
        if self.is_made:
            return max(self.host_depths)
        return int(self.depth.max())

    def positions(self, seq_len: int) -> torch.Tensor:
        """Absolute positions P + depth. [N]"""
        return self.depth + seq_len

    def is_chain(self) -> bool:
        return self._chain

    def up_to_depth(self, max_depth: int) -> "DraftTree":
        """The subtree of nodes at depth <= max_depth, node order kept (this tree when it fits)."""
        if self.max_depth <= max_depth:
            return self
        if self.is_made:  # host lists: no tensor read
            tokens, parents = self.host_lists()
            keep = [i for i, d in enumerate(self.host_depths) if d <= max(0, max_depth)]
            new_id = {old: new for new, old in enumerate(keep)}
            return DraftTree.made([tokens[i] for i in keep], [-1] + [new_id[parents[i]] for i in keep[1:]],
                                  self._probs_of(keep))
        keep = self.depth <= max(0, max_depth)
        new_id = torch.cumsum(keep, 0) - 1  # parents come before children, so kept ids stay ordered
        parents = self.parents[keep]
        return DraftTree(self.tokens[keep], torch.where(parents >= 0, new_id[parents.clamp(min=0)], parents),
                         None if self.draft_probs is None else self._probs_of(keep.nonzero().flatten().tolist()))

    def _probs_of(self, keep: list):
        """A drawn tree's rows of the kept nodes (keep: ascending node ids, the root first)."""
        if self.draft_probs is None:
            return None
        rows = [i - 1 for i in keep[1:]]
        if rows == list(range(len(rows))):  # a prefix: a view
            return self.draft_probs[: len(rows)]
        return self.draft_probs[torch.tensor(rows, device=self.draft_probs.device)]

    def first_nodes(self, n: int) -> "DraftTree":
        """Nodes 0 .. n-1 (parents come before children, so they form a tree), with their draw
        distributions for a drawn tree (this tree when it has at most n nodes)."""
        if n >= self.num_nodes:
            return self
        if self.is_made:
            tokens, parents = self.host_lists()
            probs = None if self.draft_probs is None else self.draft_probs[: n - 1]
            return DraftTree.made(tokens[:n], parents[:n], probs)
        probs = None if self.draft_probs is None else self.draft_probs[: n - 1]
        return DraftTree(self.tokens[:n], self.parents[:n], probs)

    def path_tokens(self, node: int) -> torch.Tensor:
        """Tokens of path(node), root first. [depth(node) + 1]"""
        p = self.path[node]
        return self.tokens[p[p >= 0]]

    def children(self, node: int) -> list[int]:
        return (self.parents == node).nonzero().flatten().tolist()

    def __len__(self) -> int:
        return self.num_nodes


def _checked_probs(probs, tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """A drawn tree's draw distributions, checked against its nodes, as a CPU copy."""
    if not isinstance(probs, torch.Tensor) or not probs.is_floating_point() or probs.dim() != 2:
        got = type(probs).__name__ if not isinstance(probs, torch.Tensor) else f"{probs.dtype} {tuple(probs.shape)}"
        raise TreeError(f"DraftTree.draft_probs must be a 2-D float tensor [N - 1, vocab], got {got}")
    n = tokens.numel()
    if probs.shape[0] != n - 1:
        raise TreeError(f"DraftTree.draft_probs has {probs.shape[0]} rows for {n - 1} non-root nodes")
    if n > 1 and int(tokens[1:].max()) >= probs.shape[1]:
        raise TreeError(f"DraftTree.tokens hold id {int(tokens[1:].max())} outside draft_probs' {probs.shape[1]} columns")
    probs = probs.detach().to("cpu", copy=True)
    if not bool(torch.isfinite(probs).all()) or bool((probs < 0).any()):
        raise TreeError("DraftTree.draft_probs must be finite and >= 0 (distributions)")
    # a distribution summed in its own dtype: a few ulps per term off 1 at most
    drift = float((probs.double().sum(-1) - 1).abs().max()) if n > 1 else 0.0
    if drift > 1e-4:
        raise TreeError(f"DraftTree.draft_probs rows must sum to 1 (off by {drift:.2e})")
    if n > 1:
        drawn = probs.gather(1, tokens[1:].unsqueeze(1)).squeeze(1)
        if bool((drawn <= 0).any()):
            i = int((drawn <= 0).nonzero()[0, 0])
            raise TreeError(f"DraftTree.tokens[{i + 1}]={int(tokens[i + 1])} has probability 0 in draft_probs[{i}]: "
                            "it cannot have been drawn from it")
    return probs
