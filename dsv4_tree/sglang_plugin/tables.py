"""Tree-verify tables in SGLang's vocabulary: pure tensor functions of SGLang 0.5.23's own inputs
(`req_to_token`, `req_pool_indices`, `seq_lens` = P committed, the tree as
`retrieve_next_token` / `retrieve_next_sibling`, `out_cache_loc`), no SGLang import, no host
reads of device values, no loop over requests or nodes.

SGLang's EAGLE tree convention: draft node i of request b sits at token slot
`req_to_token[req_pool_indices[b], P + i]` (`out_cache_loc`, node order); its position is
`P + depth(i)`. A row's causal length is `P + depth + 1`, so every per-row rule of SGLang's
chain metadata (page table, C4 / C128 lengths, the indexer's compressed lengths) holds for tree
rows once the length is taken from the depth; what differs is *which* slots a row names:

* SWA index lists follow the row's ancestor path (`dsv4_tree.serving.tree_swa_page_indices`).
* Compressed entries. SGLang writes the entry of a block closing at row t to
  `raw_out_loc[t] // m`, which is the entry's committed home `req_to_token[req, P + d] // m`
  (d: the closing depth) for a chain, and collides for siblings (adjacent slots share `// m`,
  and all nodes at one depth share the home). Here the first node (lowest index) at each depth
  writes to the home, every other closing node to its own scratch slot
  `scratch_start + req_pool_index * scratch_per_request + i`, which no other node of any request
  uses. For a chain every node is first at its depth, so this is SGLang's rule exactly.
* A row's branch entries (blocks closed on its own path during this verify, block order) are
  listed per row: they replace the page-table-derived C128 indices past the committed blocks,
  and are the C4 indexer's branch candidates.

DP attention: SGLang pads a verify batch's requests, not its tree; the padding requests get chain
rows (`pad_links_as_chains`), the rows SGLang's own verify gives them."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import StateError
from ..serving.swa_table import packed_tree_rows, tree_swa_page_indices
from ..serving.tables import ancestors as packed_ancestors
from ..serving.tables import append_branch, branch_entries


def parents_from_retrieve(retrieve_next_token: torch.Tensor, retrieve_next_sibling: torch.Tensor) -> torch.Tensor:
    """SGLang's first-child / next-sibling links [bs, N] (local ids, -1 = none) -> parents [bs, N]
    int64 (root -1). Pointer jumping: log2(N) gathers. The links come from SGLang's tree builder;
    their validity is its guarantee (checking would read device values)."""
    bs, n = retrieve_next_token.shape
    dev = retrieve_next_token.device
    nxt, sib = retrieve_next_token.to(torch.int64), retrieve_next_sibling.to(torch.int64)
    ids = torch.arange(n, device=dev).expand(bs, n)
    # prev[j]: j's previous sibling (j itself for a first child or the root); an extra column
    # absorbs the -1 links. Jumping along prev reaches the first child of j's sibling group.
    prev = torch.cat([ids, ids[:, :1]], 1)
    prev.scatter_(1, torch.where(sib >= 0, sib, n), ids)
    first = prev[:, :n]
    for _ in range(max(1, n.bit_length())):
        first = first.gather(1, first)
    parent_of_first = torch.full((bs, n + 1), -1, dtype=torch.int64, device=dev)
    parent_of_first.scatter_(1, torch.where(nxt >= 0, nxt, n), ids)
    parents = parent_of_first[:, :n].gather(1, first)
    parents[:, 0] = -1
    return parents


def pad_links_as_chains(retrieve_next_token: torch.Tensor, retrieve_next_sibling: torch.Tensor, bs: int):
    """SGLang's links [bs_tree, N] -> [bs, N]: the tree's rows, then `bs - bs_tree` chain rows (node i's
    child i + 1, no siblings). Under DP attention SGLang pads a verify batch to the DP width
    (`ForwardBatch._pad_inputs_to_size`: `req_pool_indices` 0, its padding row of `req_to_token`;
    `seq_lens` 1; `out_cache_loc` 0) but not the verify input's tree; as chains, the padding rows get
    the rows SGLang's own (chain) verify gives them, which read and write only that padding row's
    slots. StateError (naming the fields) when the tree has more rows than the batch."""
    have, n = retrieve_next_token.shape
    if retrieve_next_sibling.shape != retrieve_next_token.shape or have > bs:
        raise StateError(f"dsv4_tree tree verify: spec_info.retrieve_next_token {tuple(retrieve_next_token.shape)} "
                         f"and retrieve_next_sibling {tuple(retrieve_next_sibling.shape)} must have one row per "
                         f"request, at most the batch's {bs} (req_pool_indices, DP padding included)")
    if have == bs:
        return retrieve_next_token, retrieve_next_sibling
    ids = torch.arange(n, device=retrieve_next_token.device)
    chain = torch.where(ids < n - 1, ids + 1, -1).to(retrieve_next_token.dtype).expand(bs - have, n)
    none = torch.full((bs - have, n), -1, dtype=retrieve_next_sibling.dtype, device=retrieve_next_sibling.device)
    return torch.cat([retrieve_next_token, chain]), torch.cat([retrieve_next_sibling, none])


def depths(parents: torch.Tensor) -> torch.Tensor:
    """parents [bs, N] -> depth [bs, N] int64 (root 0): the engine's ancestor table, counted."""
    return (grid_ancestors(parents, parents.shape[1]) >= 0).sum(2) - 1


def grid_ancestors(parents: torch.Tensor, width: int) -> torch.Tensor:
    """parents [bs, N] (local node ids, -1 at roots) -> [bs, N, width] int64: column k = k-th
    ancestor (k = 0: the node), -1 above the root. The engine's packed-row doubling
    (`serving.tables.ancestors`) on the batch's nodes numbered b * N + i."""
    bs, n = parents.shape
    base = (torch.arange(bs, device=parents.device) * n).view(bs, 1)
    packed = torch.where(parents >= 0, parents.to(torch.int64) + base, -1).reshape(-1)
    anc = packed_ancestors(packed, width).view(bs, n, width)
    return torch.where(anc >= 0, anc - base.unsqueeze(2), -1)


def tree_verify_lengths(seq_lens: torch.Tensor, req_pool_indices: torch.Tensor, depth: torch.Tensor):
    """-> (seq_lens_casual [bs*N] int32 = P + depth + 1, req_pool_indices_repeated [bs*N] int32):
    the two inputs of SGLang's `make_core_attn_metadata` (`expand_extend_with_same_length` for a chain)."""
    bs, n = depth.shape
    lens = (seq_lens.to(torch.int64).view(bs, 1) + depth + 1).view(-1).to(torch.int32)
    rows = req_pool_indices.to(torch.int32).view(bs, 1).expand(bs, n).reshape(-1)
    return lens, rows


def first_at_depth(depth: torch.Tensor) -> torch.Tensor:
    """[bs, N] bool: node i has the lowest index among its request's nodes of its depth."""
    bs, n = depth.shape
    ids = torch.arange(n, device=depth.device).expand(bs, n)
    lowest = torch.full((bs, n), n, dtype=torch.int64, device=depth.device)
    lowest = lowest.scatter_reduce(1, depth, ids, reduce="amin")
    return lowest.gather(1, depth) == ids


def tree_entry_out_loc(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                       depth: torch.Tensor, ratio: int, scratch_start: int, scratch_per_request: int) -> torch.Tensor:
    """-> [bs*N] int64: where row (b, i)'s compressed entry of ratio m goes (SGLang's `c4_out_loc` /
    `c128_out_loc`): 0 unless the row closes a block ((P + d + 1) % m == 0, as SGLang writes 0
    there); the home `req_to_token[req, P + d] // m` for the first node at its depth; else the
    scratch slot `scratch_start + req_pool_index * scratch_per_request + i`."""
    bs, n = depth.shape
    P = seq_lens.to(torch.int64).view(bs, 1)
    req = req_pool_indices.to(torch.int64).view(bs, 1)
    closing = (P + depth + 1) % ratio == 0
    home = req_to_token[req.expand(bs, n), P + depth].to(torch.int64) // ratio
    ids = torch.arange(n, device=depth.device).expand(bs, n)
    scratch = scratch_start + req * scratch_per_request + ids
    loc = torch.where(first_at_depth(depth), home, scratch)
    return torch.where(closing, loc, torch.zeros_like(loc)).view(-1)


def tree_branch_entries(entry_out_loc: torch.Tensor, parents: torch.Tensor, seq_lens: torch.Tensor,
                        ratio: int) -> tuple:
    """-> (branch [bs*N, Kb] int64, count [bs*N]), Kb = (N - 1) // m + 1: row (b, i)'s entries of
    blocks closed on its own path in this verify (blocks P // m, P // m + 1, ..., block order), as
    slots of `entry_out_loc` [bs*N]; -1 past count. The engine's `branch_entries` on packed rows."""
    bs, n = parents.shape
    _, _, packed = packed_tree_rows(seq_lens, seq_lens, parents)
    anc = packed_ancestors(packed, n)
    P = seq_lens.to(torch.int64).repeat_interleave(n)
    pos = P + (anc >= 0).sum(1) - 1
    return branch_entries(anc, pos, P, torch.ones_like(pos, dtype=torch.bool), entry_out_loc, ratio)


def tree_c128_page_indices(c128_page_indices: torch.Tensor, branch: torch.Tensor, seq_lens_casual: torch.Tensor,
                           committed_blocks: torch.Tensor) -> torch.Tensor:
    """SGLang's page-table C128 indices [T, K] (entries 0..L//128-1, -1 after) with the row's
    branch entries [T, B] written over columns committed_blocks[t] .. L//128 - 1 (a new tensor;
    the engine's `append_branch`)."""
    n_branch = seq_lens_casual.to(torch.int64) // 128 - committed_blocks.to(torch.int64)
    return append_branch(c128_page_indices, committed_blocks, branch, n_branch)


@dataclass(frozen=True)
class TreeVerifyTables:
    """Per-row tables of one tree verify (T = bs * N rows, row b * N + i)."""
    parents: torch.Tensor  # [bs, N] int64
    depth: torch.Tensor  # [bs, N] int64
    seq_lens_casual: torch.Tensor  # [T] int32, P + depth + 1
    req_pool_indices_repeated: torch.Tensor  # [T] int32
    swa_page_indices: torch.Tensor  # [T, 128 padded to 64] int32, own path then committed
    c4_out_loc: torch.Tensor  # [T] int64 (0 on non-closing rows)
    c128_out_loc: torch.Tensor  # [T] int64
    c4_branch: torch.Tensor  # [T, B4] int64 branch C4 entry slots, block order, -1 padded
    c128_branch: torch.Tensor  # [T, B128] int64
    c4_committed: torch.Tensor  # [T] int32: P // 4, the committed C4 entries every row shares
    c128_committed: torch.Tensor  # [T] int32: P // 128
    ancestors: torch.Tensor  # [bs, N, N] int64: column k = the node's k-th ancestor, -1 above the root


def build_tree_verify_tables(*, req_to_token: torch.Tensor, full_to_swa_index_mapping: torch.Tensor,
                             req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                             retrieve_next_token: torch.Tensor, retrieve_next_sibling: torch.Tensor,
                             swa_window: int, scratch_start: dict, scratch_per_request: int,
                             page_index_aligned_size: int = 64) -> TreeVerifyTables:
    """All tree tables of one verify from SGLang's inputs. scratch_start: {4: first C4 scratch
    slot, 128: first C128 scratch slot} (past the pools' committed entry slots). Requests past the
    tree's rows (SGLang's DP padding) are chains (`pad_links_as_chains`)."""
    bs = req_pool_indices.shape[0]
    if seq_lens.shape != (bs,):
        raise StateError(f"dsv4_tree tree verify: seq_lens {tuple(seq_lens.shape)} must hold one length per "
                         f"request of req_pool_indices ({bs})")
    parents = parents_from_retrieve(*pad_links_as_chains(retrieve_next_token, retrieve_next_sibling, bs))
    depth = depths(parents)
    n = depth.shape[1]
    lens, rows = tree_verify_lengths(seq_lens, req_pool_indices, depth)
    swa = tree_swa_page_indices(req_to_token, full_to_swa_index_mapping, req_pool_indices, seq_lens, parents,
                                swa_window, page_index_aligned_size)
    anc = grid_ancestors(parents, n)
    out, branch, committed = {}, {}, {}
    for m in (4, 128):
        out[m] = tree_entry_out_loc(req_to_token, req_pool_indices, seq_lens, depth, m, scratch_start[m],
                                    scratch_per_request)
        branch[m] = tree_branch_entries(out[m], parents, seq_lens, m)[0]
        committed[m] = (seq_lens.to(torch.int32) // m).view(bs, 1).expand(bs, n).reshape(-1)
    return TreeVerifyTables(parents, depth, lens, rows, swa, out[4], out[128], branch[4], branch[128],
                            committed[4], committed[128], anc)
