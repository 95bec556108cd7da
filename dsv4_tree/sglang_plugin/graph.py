"""SGLang 0.5.23's CUDA-graph protocol for the tree backends: the raw metadata records that
carry a round's tree inputs from the out-of-graph prep into the captured metadata build.

SGLang's DeepSeek-V4 backend splits a graphed step in two: `init_forward_metadata_out_graph`
(before each replay) builds a small raw record (`DSV4RawVerifyMetadata` / `DSV4RawDecodeMetadata`:
request rows, lengths, write slots) and `replay_cuda_graph_metadata_from` copies it into the
record captured for that batch size (`copy_`); `init_forward_metadata_in_graph`, recorded inside
the graph, builds the full metadata from the captured record's tensors. The tree rows need two
more inputs, so the records here carry them and copy them the same way:
* target verify: the tree (`retrieve_next_token` / `retrieve_next_sibling` [bs, N]; SGLang's
  capture batch has none, and padding requests, SGLang's or the bucket's, get chains);
* draft decode: the batch's multi-step write slots (`draft_out_cache_loc` [bs * topk * steps];
  SGLang's decode record holds one slot per request).
Their tensors are allocated once per captured batch size (at capture) and only copied into
afterwards, so the captured build reads the same addresses on every replay."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from sglang.srt.layers.attention import deepseek_v4_backend as dsv4

from ..errors import StateError
from .tables import pad_links_as_chains


@dataclass
class TreeRawVerifyMetadata(dsv4.DSV4RawVerifyMetadata):
    """SGLang's raw verify record plus the batch's tree (every request of the record: the real
    requests' links, then chains for padding requests)."""
    retrieve_next_token: Optional[torch.Tensor] = None  # [bs, N] int64 first child, -1 none
    retrieve_next_sibling: Optional[torch.Tensor] = None  # [bs, N] int64 next sibling, -1 none

    def copy_(self, other: "TreeRawVerifyMetadata"):
        super().copy_(other)
        self.retrieve_next_token.copy_(other.retrieve_next_token)
        self.retrieve_next_sibling.copy_(other.retrieve_next_sibling)


@dataclass
class TreeRawDecodeMetadata(dsv4.DSV4RawDecodeMetadata):
    """SGLang's raw decode record of one draft step plus the batch's multi-step write slots."""
    draft_out_cache_loc: Optional[torch.Tensor] = None  # [bs * topk * num_steps], (bs, topk, steps) order

    def copy_(self, other: "TreeRawDecodeMetadata"):
        super().copy_(other)
        self.draft_out_cache_loc.copy_(other.draft_out_cache_loc)


def chain_links(bs: int, n: int, device) -> tuple:
    """Links [bs, N] int64 of bs chains (node i's child i + 1): the tree of a capture batch."""
    empty = torch.full((0, n), -1, dtype=torch.int64, device=device)
    return pad_links_as_chains(empty, empty, bs)


def sglang_warmup_forward() -> bool:
    """SGLang's discarded warm-up forwards (its FlashInfer autotune dummy runs), which build verify
    metadata for a dummy batch with no tree, as its graph capture does."""
    from sglang.srt.layers.logits_processor import get_in_autotune_dummy_run

    return bool(get_in_autotune_dummy_run())


def verify_links(spec_info, bs: int, n: int, device, capture: bool = False) -> tuple:
    """The links of a verify batch of bs requests: spec_info's tree (one row per real request),
    padding requests as chains. A batch whose spec_info carries no tree verifies as bs chains only
    in SGLang's graph capture (`capture`) and its warm-up forwards; anywhere else it is a
    StateError naming the missing fields. New tensors."""
    nxt = getattr(spec_info, "retrieve_next_token", None)
    sib = getattr(spec_info, "retrieve_next_sibling", None)
    if nxt is None or sib is None:
        if capture or sglang_warmup_forward():
            return chain_links(bs, n, device)
        missing = [name for name, x in (("retrieve_next_token", nxt), ("retrieve_next_sibling", sib)) if x is None]
        raise StateError(f"dsv4_tree tree verify: the verify batch's spec_info ({type(spec_info).__name__}) carries "
                         f"no tree ({' and '.join(missing)} missing); only SGLang's graph capture verifies chains")
    if nxt.shape[1] != n:
        raise StateError(f"dsv4_tree tree verify: spec_info.retrieve_next_token has {nxt.shape[1]} nodes per "
                         f"request, the backend verifies speculative_num_draft_tokens = {n}")
    nxt, sib = pad_links_as_chains(nxt.to(torch.int64), sib.to(torch.int64), bs)
    return nxt.clone(), sib.clone()


def tree_raw_verify(raw: dsv4.DSV4RawVerifyMetadata, links: tuple) -> TreeRawVerifyMetadata:
    return TreeRawVerifyMetadata(**{f: getattr(raw, f) for f in raw.__dataclass_fields__},
                                 retrieve_next_token=links[0], retrieve_next_sibling=links[1])
