"""The per-path oracle: one standalone Hugging Face forward per node, no cache."""
from __future__ import annotations

import torch

from ..tree.draft_tree import DraftTree


def _hf(model):
    return getattr(model, "hf", model)


@torch.no_grad()
def sequence_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """HF forward (no cache) over ids [L]; logits of every position. [L, vocab]"""
    hf = _hf(model)
    ids = torch.as_tensor(ids, dtype=torch.int64).to(hf.lm_head.weight.device).unsqueeze(0)
    return hf(input_ids=ids, use_cache=False).logits[0]


@torch.no_grad()
def per_path_logits(model, committed_ids, tree: DraftTree) -> torch.Tensor:
    """Row i: the model's logits at the last position of committed_ids ++ tokens of path(i),
    each computed by its own forward from scratch. [N, vocab]"""
    committed = torch.as_tensor(committed_ids, dtype=torch.int64).cpu()
    rows = []
    for i in range(tree.num_nodes):
        seq = torch.cat([committed, tree.path_tokens(i)])
        rows.append(sequence_logits(model, seq)[-1])
    return torch.stack(rows)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Worst row of max|a - e| / max|e| (rows = nodes)."""
    a, e = actual.double().cpu(), expected.double().cpu()
    num = (a - e).abs().amax(dim=-1)
    den = e.abs().amax(dim=-1).clamp(min=1e-30)
    return float((num / den).max())
