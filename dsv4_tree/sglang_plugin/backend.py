"""Tree-aware subclasses of SGLang 0.5.23's DeepSeek-V4 attention backends (returned by the
factory hooks when EAGLE topk > 1).

* Construction: SGLang's `__init__` asserts topk in [0, 1]; it runs here while the backend
  module's `get_spec` reports topk 1 (everything else forwarded), then the real topk is set.
  Only the plain paged-SWA pool without low-ratio layers is accepted.
* Target verify: eager `init_forward_metadata` keeps the batch's tree (`spec_info`) for
  `make_forward_metadata_from_raw_verify`, which builds tree rows (`metadata.py`).
* CUDA graphs (SGLang's protocol, `graph.py`): the out-of-graph prep builds SGLang's raw record
  plus the round's tree (verify) or multi-step write slots (draft decode) and copies it into the
  record captured for the batch size; the captured `init_forward_metadata_in_graph` builds the
  tree metadata from that record's tensors only (no host read, shapes fixed by the bucket).
* Tree verify's compressor writes (KV and indexer compressors): each closing node's entry from
  its own path (`compressor.py`), with dsv4-tree's branch compressor; the ops come from
  `DSV4_TREE_SGLANG_OPS` ("triton", the default, or "torch"). The pool's C4 / C128 entry
  buffers are grown by the scratch slots at construction (`scratch.py`).
* The C4 indexer on tree metadata (`indexer.py`): per-branch candidates. SGLang's own logits
  call over the page table, the same function over each row's scratch pages, the row's scratch
  blocks' scores spliced in, SGLang's top-k transform, then each selected branch block remapped
  to its own entry's slot (home or scratch) for the sparse attention. A chain's rows get SGLang's
  result unchanged.
* Draft decode (the multi-step backend's step backends): `bs x topk` SWA-only rows per step,
  each branch a chain over its own draft slots (`draft_metadata.py`); eager
  `init_forward_metadata` keeps the batch's multi-step `out_cache_loc` for it."""
from __future__ import annotations

import contextlib
import os

import torch
from sglang.srt.layers.attention import deepseek_v4_backend as dsv4

from ..attention.backend import get_backend
from ..errors import ConfigError, StateError
from .compressor import tree_compress
from .commit import check_no_pending_commit
from .draft_metadata import draft_step_metadata
from .graph import TreeRawDecodeMetadata, tree_raw_verify, verify_links
from .indexer import tree_c4_indexer
from .metadata import TreeDSV4Metadata, tree_verify_metadata
from .scratch import check_no_cached_addresses, ensure_scratch

OPS_ENV = "DSV4_TREE_SGLANG_OPS"  # the branch compressor's implementation: "triton" (default) or "torch"

GLUE_REFUSAL = ("dsv4_tree tree verify: the out-of-graph prep copies the round's tree from the live verify "
                "input (spec_info), which a metadata glue graph would read at its capture-time address")


class _SpecView:
    """get_spec() as SGLang's backend __init__ sees it: the overridden fields (topk 1 for the tree
    backends), everything else the real spec."""

    def __init__(self, spec, overrides: dict):
        self._spec = spec
        self._overrides = overrides

    def __getattr__(self, name):
        return self._overrides[name] if name in self._overrides else getattr(self._spec, name)


@contextlib.contextmanager
def spec_view(**overrides):
    """Yields the real get_spec (also when nested: the multi-step backend builds its step
    backends inside its own __init__) while the backend module's get_spec reports `overrides`."""
    before = dsv4.get_spec
    real = getattr(before, "dsv4_tree_real", before)

    def viewed():
        return _SpecView(real(), overrides)

    viewed.dsv4_tree_real = real
    dsv4.get_spec = viewed
    try:
        yield real
    finally:
        dsv4.get_spec = before


def _topk_one_view():
    return spec_view(speculative_eagle_topk=1)


def _check_pool(backend) -> None:
    pool = backend.token_to_kv_pool
    if getattr(pool, "request_window", None) is not None or getattr(pool, "swa_req_ring_size", None) is not None \
            or getattr(pool, "unified_kv_pool", None) is not None:
        raise ConfigError("dsv4_tree tree verify needs SGLang's paged SWA pool (no request window, SWA ring or "
                          "unified KV pool)")
    if getattr(backend, "hisparse_coordinator", None) is not None:
        raise ConfigError("dsv4_tree tree verify: HiSparse (--enable-hisparse, hisparse_coordinator) is not supported")
    check_no_cached_addresses(pool)
    if backend.low_ratios:
        raise ConfigError(f"dsv4_tree tree verify: low-ratio compressed layers {backend.low_ratios} "
                          f"(DeepSeek-V4.1) are not supported")


class _TreeMixin:
    def _tree_init(self, real_get_spec) -> None:
        self.topk = int(real_get_spec().speculative_eagle_topk)
        self.mtp_enabled = True
        self._tree_links = None
        self._tree_draft_out_cache_loc = None
        _check_pool(self)
        self._tree_ops = get_backend(os.environ.get(OPS_ENV, "triton"))
        ensure_scratch(self.token_to_kv_pool, int(real_get_spec().speculative_num_draft_tokens))


class TreeDeepseekV4AttnBackend(_TreeMixin, dsv4.DeepseekV4AttnBackend):
    def __init__(self, model_runner, **kwargs):
        with _topk_one_view() as real_get_spec:
            super().__init__(model_runner, **kwargs)
        self._tree_init(real_get_spec)

    def init_forward_metadata(self, forward_batch) -> None:
        mode = dsv4._get_logical_forward_mode(forward_batch)
        self._tree_links = (verify_links(forward_batch.spec_info, forward_batch.batch_size,
                                         self.speculative_num_draft_tokens, forward_batch.seq_lens.device)
                            if mode.is_target_verify() else None)
        self._tree_draft_out_cache_loc = forward_batch.out_cache_loc if mode.is_decode() else None
        try:
            super().init_forward_metadata(forward_batch)
        finally:
            self._tree_links = None
            self._tree_draft_out_cache_loc = None

    def glue_target_verify_metadata(self) -> str:
        return GLUE_REFUSAL

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False) -> None:
        """SGLang's out-of-graph prep of a graphed step. Target verify: SGLang's own (raw record,
        padded to the bucket), with the round's tree in the record; draft decode: the raw record
        with the batch's multi-step write slots (`draft_out_graph`)."""
        mode = forward_batch.forward_mode
        if mode.is_target_verify():
            self._tree_links = verify_links(None if in_capture else forward_batch.spec_info,
                                            forward_batch.batch_size, self.speculative_num_draft_tokens,
                                            forward_batch.seq_lens.device, capture=in_capture)
            try:
                return super().init_forward_metadata_out_graph(forward_batch, in_capture=in_capture)
            finally:
                self._tree_links = None
        if mode.is_decode_or_idle():
            return self.draft_out_graph(forward_batch, in_capture)
        return super().init_forward_metadata_out_graph(forward_batch, in_capture=in_capture)

    def draft_out_graph(self, forward_batch, in_capture: bool) -> None:
        """What SGLang's decode prep does (idle substitution, raw record, copy into the captured
        record), with the batch's bs * topk * num_steps write slots kept in the record."""
        bs = forward_batch.batch_size
        want = bs * self.topk * self.speculative_num_steps
        req, seq = forward_batch.req_pool_indices[:bs], forward_batch.seq_lens[:bs]
        actual = getattr(forward_batch, "actual_forward_mode", forward_batch.forward_mode)
        loc = forward_batch.out_cache_loc
        if actual.is_idle():
            req, seq = torch.zeros_like(req), torch.ones_like(seq)
        if in_capture or actual.is_idle():
            loc = torch.zeros(want, dtype=torch.int64, device=seq.device)
        elif loc is None or loc.shape[0] != want:
            raise StateError(f"dsv4_tree draft decode (EAGLE topk={self.topk}): a graphed draft step of {bs} "
                             f"requests needs the multi-step out_cache_loc of bs * topk * num_steps = {want} "
                             f"slots, got {None if loc is None else loc.shape[0]}")
        self.online_c128_mtp.prepare_forward(actual, req, seq)
        raw = TreeRawDecodeMetadata(req_pool_indices=req, seq_lens=seq,
                                    out_cache_loc=loc.view(bs, self.topk, -1)[:, :, self.speculative_step_id],
                                    draft_out_cache_loc=loc)
        self.replay_cuda_graph_metadata_from(bs=bs, temp_metadata=raw, bucket=dsv4._GraphBucket.DECODE_OR_IDLE)
        if in_capture:
            self._current_capture_raw = self.forward_metadata

    def init_forward_metadata_target_verify(self, *args, **kwargs):
        """SGLang's raw verify record with the round's tree (`_tree_links`, set by the eager
        `init_forward_metadata` or the out-of-graph prep: both run outside any graph)."""
        check_no_pending_commit(self.token_to_kv_pool, "a tree verify")
        links = self._tree_links
        if links is None:
            raise StateError("dsv4_tree tree verify: target-verify metadata requested without the batch's tree "
                             "(spec_info.retrieve_next_token / retrieve_next_sibling)")
        return tree_raw_verify(super().init_forward_metadata_target_verify(*args, **kwargs), links)

    def make_forward_metadata_from_raw_verify(self, raw_metadata, online_c128_state_slot_offset: int = 0,
                                              graph_backed: bool = False):
        """The captured part of a verify (and the eager build): tree metadata from the record's
        tensors only."""
        if getattr(raw_metadata, "retrieve_next_token", None) is None:
            raise StateError("dsv4_tree tree verify: a raw verify record without the batch's tree "
                             "(retrieve_next_token / retrieve_next_sibling)")
        if raw_metadata.verify_lens is not None:
            raise ConfigError("dsv4_tree tree verify: ragged verify layouts are not supported "
                              "(SGLANG_RAGGED_VERIFY_MODE must be 'static')")
        return tree_verify_metadata(self, raw_metadata, raw_metadata.retrieve_next_token,
                                    raw_metadata.retrieve_next_sibling)

    def forward_core_compressor(self, x, forward_batch, layer_id, compressor):
        meta = getattr(self, "forward_metadata", None)
        if not isinstance(meta, TreeDSV4Metadata):
            return super().forward_core_compressor(x, forward_batch, layer_id, compressor)
        if forward_batch.forward_mode.is_idle():
            return None
        tree_compress(pool=self.token_to_kv_pool, req_to_token=self.req_to_token, tables=meta.tree,
                      out_cache_loc=meta.core_attn_metadata.raw_out_loc, compressor=compressor,
                      kv_score=compressor.compute_kv_score(x, forward_batch), layer_id=layer_id, ops=self._tree_ops)
        return None

    forward_indexer_compressor = forward_core_compressor

    def forward_c4_indexer(self, x, q_lora, c4_indexer, forward_batch, *args, **kwargs):
        meta = getattr(self, "forward_metadata", None)
        if not isinstance(meta, TreeDSV4Metadata) or forward_batch.forward_mode.is_idle():
            return super().forward_c4_indexer(x, q_lora, c4_indexer, forward_batch, *args, **kwargs)
        return tree_c4_indexer(self, meta, x, q_lora, c4_indexer, forward_batch, *args, **kwargs)

    def init_forward_metadata_decode(self, max_seq_len, req_pool_indices, seq_lens, out_cache_loc):
        """SGLang's raw decode record (eager: the step's slice of write slots, one per branch), with
        the batch's multi-step write slots the eager `init_forward_metadata` kept."""
        bs = req_pool_indices.shape[0]
        if seq_lens.shape[0] != bs or out_cache_loc.shape[0] != bs * self.topk:
            raise StateError(f"dsv4_tree draft decode (EAGLE topk={self.topk}): {bs} requests need {bs} seq_lens "
                             f"and {bs * self.topk} write slots (bs * topk), got {seq_lens.shape[0]} and "
                             f"{out_cache_loc.shape[0]}")
        return TreeRawDecodeMetadata(req_pool_indices=req_pool_indices, seq_lens=seq_lens,
                                     out_cache_loc=out_cache_loc, draft_out_cache_loc=self._tree_draft_out_cache_loc)

    def make_forward_metadata_from_raw_decode(self, raw_metadata):
        out_cache_loc = getattr(raw_metadata, "draft_out_cache_loc", None)
        want = raw_metadata.req_pool_indices.shape[0] * self.topk * self.speculative_num_steps
        if out_cache_loc is None or out_cache_loc.shape[0] != want:
            raise StateError(f"dsv4_tree draft decode (EAGLE topk={self.topk}): metadata needs the batch's multi-step "
                             f"out_cache_loc of bs * topk * num_steps = {want} slots, got "
                             f"{None if out_cache_loc is None else out_cache_loc.shape[0]}")
        return draft_step_metadata(self, raw_metadata, out_cache_loc)


class TreeDeepseekV4MultiStepBackend(_TreeMixin, dsv4.DeepseekV4MultiStepBackend):
    def __init__(self, model_runner, topk: int, speculative_num_steps: int):
        with _topk_one_view() as real_get_spec:
            super().__init__(model_runner, topk=topk, speculative_num_steps=speculative_num_steps)
        self._tree_init(real_get_spec)
        self.topk = topk

    def _make_step_backend(self, model_runner, step_id: int):
        return TreeDeepseekV4AttnBackend(model_runner, speculative_step_id=step_id, topk=self.topk,
                                         speculative_num_steps=self.speculative_num_steps)
