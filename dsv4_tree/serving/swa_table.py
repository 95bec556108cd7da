"""SWA index table of a tree verify, in SGLang's vocabulary (`swa_page_indices`).

SGLang's chain rule (`build_causal_swa_page_indices`): a verify row with causal length L lists,
newest first, the SWA slots of positions L-1, L-2, ..., L-W of its request (W = swa_window), -1
where the position is negative, padded with -1 to a multiple of `page_index_aligned_size` columns.

A tree row differs only in which slots it names: draft node i of request b (depth d, position
P + d) sits at `req_to_token[req_pool_indices[b], P + i]` (SGLang's EAGLE tree convention), so its
own path contributes columns 0..d as `P + ancestor_k(i)` (the k-th ancestor, k = 0 being i itself)
and the committed positions P-1, P-2, ... follow at columns d+1, d+2, ... . For a chain
(ancestor_k(i) = i - k) this is exactly the chain rule."""
from __future__ import annotations

import torch

from ..errors import InputError
from .tables import ancestors, path_slots


def tree_swa_page_indices(req_to_token: torch.Tensor, full_to_swa_mapping: torch.Tensor,
                          req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, parents: torch.Tensor,
                          swa_window: int, page_index_aligned_size: int = 64) -> torch.Tensor:
    """-> int32 [bs * N, ceil(W / page_index_aligned_size) * page_index_aligned_size], row b * N + i.

    req_to_token [rows, max_len] int (request row, position) -> full slot; full_to_swa_mapping
    [num_full_slots] int full slot -> SWA slot; req_pool_indices [bs] int; seq_lens [bs] int
    (P, committed); parents [bs, N] int64 with parents[b, 0] = -1 and parents[b, i] < i (a
    well-formed tree is the caller's guarantee: checking it would read device values). Every
    gathered `req_to_token` column is < P + N. The engine's table functions on packed rows
    (`tables.ancestors`, `tables.path_slots`): log2(min(W, N)) ancestor doublings, no loop over
    rows."""
    if parents.dim() != 2 or parents.dtype != torch.int64:
        raise InputError(f"parents must be int64 [bs, N], got {parents.dtype} {tuple(parents.shape)}")
    bs, n = parents.shape
    if req_pool_indices.shape != (bs,) or seq_lens.shape != (bs,):
        raise InputError(f"req_pool_indices and seq_lens must be [bs={bs}], got "
                         f"{tuple(req_pool_indices.shape)} and {tuple(seq_lens.shape)}")
    if req_to_token.dim() != 2 or full_to_swa_mapping.dim() != 1:
        raise InputError(f"req_to_token must be 2-D and full_to_swa_mapping 1-D, got "
                         f"{tuple(req_to_token.shape)} and {tuple(full_to_swa_mapping.shape)}")
    if swa_window <= 0 or page_index_aligned_size <= 0:
        raise InputError(f"swa_window and page_index_aligned_size must be > 0, "
                         f"got {swa_window=} {page_index_aligned_size=}")
    req, nodes, packed = packed_tree_rows(req_pool_indices, seq_lens, parents)
    anc = ancestors(packed, min(swa_window, n))  # [T, min(W, N)] packed rows: own path first
    P = seq_lens.to(torch.int64).repeat_interleave(n)
    pos = P + (anc >= 0).sum(1) - 1  # P + depth
    swa_of = lambda cols: full_to_swa_mapping[req_to_token[req.view(-1, 1), cols.clamp_min(0)].to(torch.int64)]  # noqa: E731
    node_swa = swa_of((P + nodes).view(-1, 1)).view(-1)
    q = pos.view(-1, 1) - torch.arange(swa_window, device=parents.device)  # newest first
    swa = path_slots(anc, pos, P, node_swa, swa_of(q), q).to(torch.int32)
    padded = -(-swa_window // page_index_aligned_size) * page_index_aligned_size
    return torch.nn.functional.pad(swa, (0, padded - swa_window), value=-1)


def packed_tree_rows(req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, parents: torch.Tensor) -> tuple:
    """[bs, N] trees -> (req_pool_indices [T], node ids [T], packed parents [T]) of rows b * N + i
    (parents numbered by packed row, -1 at roots): the engine's packed-row form."""
    bs, n = parents.shape
    ids = torch.arange(n, device=parents.device)
    base = (torch.arange(bs, device=parents.device) * n).view(bs, 1)
    packed = torch.where(parents >= 0, parents.to(torch.int64) + base, -1).reshape(-1)
    return req_pool_indices.to(torch.int64).repeat_interleave(n), ids.repeat(bs), packed
