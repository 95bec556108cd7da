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


def _ancestor_columns(parents: torch.Tensor, width: int) -> torch.Tensor:
    """parents [bs, N] -> [bs, N, width] int64: column k = k-th ancestor's node index, -1 above the root."""
    bs, n = parents.shape
    node = torch.arange(n, device=parents.device).expand(bs, n)
    cols = [node]
    for _ in range(width - 1):
        up = torch.gather(parents, 1, cols[-1].clamp_min(0))
        cols.append(torch.where(cols[-1] >= 0, up, -1))
    return torch.stack(cols, dim=2)


def tree_swa_page_indices(req_to_token: torch.Tensor, full_to_swa_mapping: torch.Tensor,
                          req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, parents: torch.Tensor,
                          swa_window: int, page_index_aligned_size: int = 64) -> torch.Tensor:
    """-> int32 [bs * N, ceil(W / page_index_aligned_size) * page_index_aligned_size], row b * N + i.

    req_to_token [rows, max_len] int (request row, position) -> full slot; full_to_swa_mapping
    [num_full_slots] int full slot -> SWA slot; req_pool_indices [bs] int; seq_lens [bs] int
    (P, committed); parents [bs, N] int64 with parents[b, 0] = -1 and parents[b, i] < i (a
    well-formed tree is the caller's guarantee: checking it would read device values). Every
    gathered `req_to_token` column is < P + N. Vectorised: the only loop runs over
    min(W, N) - 1 ancestor steps."""
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
    device = parents.device
    width = swa_window
    anc = _ancestor_columns(parents, min(width, n))  # [bs, N, min(W, N)]
    path_len = (anc >= 0).sum(dim=2, keepdim=True)  # [bs, N, 1]: depth + 1 (capped at W)
    if width > n:
        anc = torch.nn.functional.pad(anc, (0, width - n), value=-1)
    k = torch.arange(width, device=device)  # [W]
    P = seq_lens.to(torch.int64).view(bs, 1, 1)
    position = P + path_len - 1 - k  # [bs, N, W]: column k's position where k >= path_len, else >= P
    column = torch.where(k < path_len, P + anc, position)  # [bs, N, W]: req_to_token column of the key
    valid = position >= 0
    rows = req_to_token[req_pool_indices.to(torch.int64).view(bs, 1, 1), column.clamp_min(0)]
    swa = full_to_swa_mapping[rows.to(torch.int64)].to(torch.int32)
    swa = swa.masked_fill(~valid, -1).view(bs * n, width)
    padded = -(-width // page_index_aligned_size) * page_index_aligned_size
    return torch.nn.functional.pad(swa, (0, padded - width), value=-1)
