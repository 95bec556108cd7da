"""TreeBatch: a round's drafted trees as [B, N] tensors on the model's device.

Drafters build their trees batched, at fixed shapes, on the device: row b holds request b's
tree, node 0 its root, nodes at or past counts[b] padding (parent -1, token 0). What SGLang's
kernels read is derived from the same tensors (depth, positions, retrieve_index / next_token /
next_sibling). `trees()` is the draft's one host read: every row's tokens, parents and count in
one copy, each row made a DraftTree (DraftTree.made: not re-checked, host lists kept);
`trees_and` / `trees_with` bring what else the host needs of the round in the same copy."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..errors import TreeError
from .build import links_from_parents
from .draft_tree import DraftTree, depth_by_pointer_jumping


@dataclass(frozen=True)
class TreeBatch:
    tokens: torch.Tensor  # [B, N] int64, node 0 the root
    parents: torch.Tensor  # [B, N] int64, parents[b, i] < i; -1 at the root and at padding
    counts: torch.Tensor | None = None  # [B] int64 node counts, None: every row has N nodes

    def __post_init__(self) -> None:
        if self.tokens.dim() != 2 or self.tokens.shape != self.parents.shape:
            raise TreeError(f"TreeBatch needs tokens and parents of one [B, N] shape, got "
                            f"{tuple(self.tokens.shape)} and {tuple(self.parents.shape)}")
        if self.counts is not None and self.counts.shape != self.tokens.shape[:1]:
            raise TreeError(f"TreeBatch.counts must be [B] = [{self.tokens.shape[0]}], got {tuple(self.counts.shape)}")

    @property
    def shape(self) -> tuple:
        return tuple(self.tokens.shape)

    @property
    def depth(self) -> torch.Tensor:
        """[B, N] depth of every node (padding: 0)."""
        return depth_by_pointer_jumping(self.parents)

    def positions(self, seq_lens: torch.Tensor) -> torch.Tensor:
        """[B, N] absolute positions seq_len + depth (SGLang's positions, per row)."""
        return seq_lens.to(self.tokens.device).unsqueeze(1) + self.depth

    def links(self) -> tuple:
        """(retrieve_index [B, N] = b * N + i, retrieve_next_token, retrieve_next_sibling [B, N]):
        SGLang's first-child / next-sibling lists, children in increasing id (-1: none)."""
        b, n = self.tokens.shape
        first, sib = links_from_parents(self.parents)
        return torch.arange(b * n, device=self.tokens.device).view(b, n), first, sib

    def trees(self, draft_probs: torch.Tensor | None = None) -> list:
        """One DraftTree per row, from one host read of the whole batch; draft_probs [B, N - 1, V]:
        a drawn batch's draw distributions, each tree given its rows (views, not read)."""
        return self._read(None, draft_probs)[0]

    def trees_and(self, extra: torch.Tensor, draft_probs: torch.Tensor | None = None) -> tuple:
        """(trees, extra's values as Python floats): `extra` [k] float64 (what the drafter decided
        on the device beside the trees, e.g. its budget) rides in the same read, bit for bit."""
        return self._read(extra, draft_probs)[:2]

    def trees_with(self, extra: torch.Tensor, payload: torch.Tensor | None) -> tuple:
        """`trees_and` with a payload [B, W] float64 (None: none) in the same read, e.g. the
        round's candidate pool for the value learner -> (trees, extra's floats, the payload as a
        host numpy array [B, W] float64 or None)."""
        return self._read(extra, None, payload)

    def _read(self, extra, draft_probs=None, payload=None) -> tuple:
        b, n = self.tokens.shape
        cols = [self.tokens, self.parents]
        if self.counts is not None:
            cols.append(self.counts.unsqueeze(1).to(torch.int64))
        parts = [torch.cat(cols, 1).reshape(-1)]
        for more in (extra, payload):  # float64 bits as int64: exact through the one copy
            if more is not None:
                parts.append(more.to(self.tokens.device, torch.float64).reshape(-1).view(torch.int64))
        packed = torch.cat(parts) if len(parts) > 1 else parts[0]
        host = packed.cpu().numpy() if packed.device.type != "cpu" else packed.numpy()  # the one read
        width = 2 * n + (self.counts is not None)
        flat = host[: b * width].tolist()
        out = []
        for i in range(b):
            row = flat[i * width : (i + 1) * width]
            c = row[2 * n] if self.counts is not None else n
            out.append(DraftTree.made(row[:c], row[n : n + c], None if draft_probs is None else draft_probs[i, : c - 1]))
        at = b * width
        tail = []
        if extra is not None:
            tail = host[at : at + extra.numel()].view(np.float64).tolist()
            at += extra.numel()
        rows = None if payload is None else host[at:].view(np.float64).reshape(payload.shape)
        return out, tail, rows

    def first(self, b: int) -> "TreeBatch":
        """Rows 0 .. b - 1 (views): the real requests of a bucket's static outputs."""
        return TreeBatch(self.tokens[:b], self.parents[:b], None if self.counts is None else self.counts[:b])

    def contiguous(self) -> "TreeBatch":
        """The same batch in memory of its own (a captured graph's static outputs)."""
        return TreeBatch(self.tokens.contiguous(), self.parents.contiguous(),
                         None if self.counts is None else self.counts.contiguous())

    @classmethod
    def chains(cls, tokens: torch.Tensor, counts: torch.Tensor | None = None) -> "TreeBatch":
        """tokens [B, N] as B chains (node i's parent i - 1), each cut to its count if given
        (parents -1 past it)."""
        ar = torch.arange(tokens.shape[1], device=tokens.device)
        parents = (ar - 1).expand(tokens.shape)
        if counts is not None:
            parents = torch.where(ar < counts.unsqueeze(1), parents, -1)
        return cls(tokens, parents, counts)

    @classmethod
    def from_trees(cls, trees: list, device=None) -> "TreeBatch":
        """DraftTrees padded to the batch's largest (the public trees as one batch)."""
        n = max(t.num_nodes for t in trees)
        tokens = torch.zeros(len(trees), n, dtype=torch.int64)
        parents = torch.full((len(trees), n), -1, dtype=torch.int64)
        for b, t in enumerate(trees):
            tokens[b, : t.num_nodes] = t.tokens
            parents[b, : t.num_nodes] = t.parents
        counts = torch.tensor([t.num_nodes for t in trees])
        return cls(tokens.to(device), parents.to(device), counts.to(device))
