"""The per-path oracle: one standalone Hugging Face forward per node, no cache."""
from __future__ import annotations

import contextlib

import torch

from ..errors import InputError
from ..model.full_forward import hf_of
from ..tree.draft_tree import DraftTree


def _stable_rank(module, args, scores):
    """Replace indexer scores [B, S, T] by minus their rank in a stable descending sort: the
    order is unchanged except that exact ties now go to the lower (earlier) entry."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    ranks = torch.empty_like(order)
    ranks.scatter_(-1, order, torch.arange(scores.shape[-1], device=scores.device).expand_as(order))
    return -ranks.to(scores.dtype)


@contextlib.contextmanager
def tie_rule(model):
    """Make HF's indexer break exact top-k ties by our rule (design_notes/indexer-tie-rule.md).

    HF's scores feed only its top-k, whose choice among equal scores is unspecified; this
    fixes that choice and changes nothing where there is no tie."""
    hf = hf_of(model)
    handles = [m.register_forward_hook(_stable_rank) for name, m in hf.named_modules() if name.endswith("indexer.scorer")]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def per_path_logits(model, committed_ids, tree: DraftTree, apply_tie_rule: bool = True,
                    batch_by_depth: bool = False) -> torch.Tensor:
    """Row i: the model's logits at the last position of committed_ids ++ tokens of path(i),
    each computed by its own forward from scratch. [N, vocab]

    apply_tie_rule: break exact indexer top-k ties by our documented rule (the only freedom
    the HF oracle leaves); False runs HF untouched.
    batch_by_depth: run the paths of one depth (equal lengths, no padding) as one batched
    forward; the same computation per row, fewer calls (rounding may differ by batch size)."""
    if not isinstance(tree, DraftTree):
        raise InputError(f"tree must be a dsv4_tree.DraftTree, got {type(tree).__name__}")
    committed = torch.as_tensor(committed_ids)
    if committed.is_floating_point() or committed.is_complex() or committed.dtype == torch.bool:
        raise InputError(f"committed_ids must hold integer token ids, got {committed.dtype}")
    committed = committed.long().cpu().reshape(-1)
    vocab = hf_of(model).config.vocab_size
    for name, ids in (("committed_ids", committed), ("tree.tokens", tree.tokens)):
        bad = ids[(ids < 0) | (ids >= vocab)]
        if bad.numel():
            raise InputError(f"{name}: token id {int(bad[0])} outside the vocabulary [0, {vocab})")
    rows = [None] * tree.num_nodes
    groups = [[i] for i in range(tree.num_nodes)]
    if batch_by_depth:
        groups = [(tree.depth == d).nonzero().flatten().tolist() for d in range(tree.max_depth + 1)]
    hf = hf_of(model)
    with tie_rule(model) if apply_tie_rule else contextlib.nullcontext():
        for group in groups:
            seqs = torch.stack([torch.cat([committed, tree.path_tokens(i)]) for i in group])
            logits = hf(input_ids=seqs.to(hf.lm_head.weight.device), use_cache=False).logits[:, -1]
            for i, row in zip(group, logits):
                rows[i] = row
    return torch.stack(rows)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Worst row of max|a - e| / max|e| (rows = nodes)."""
    a, e = actual.double().cpu(), expected.double().cpu()
    num = (a - e).abs().amax(dim=-1)
    den = e.abs().amax(dim=-1).clamp(min=1e-30)
    return float((num / den).max())
