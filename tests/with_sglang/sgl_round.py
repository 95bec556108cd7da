"""One EAGLE round on a real DeepSeek-V4 pool, the way SGLang 0.5.23 runs it for topk > 1, with
the plug-in's write side: tree verify writes -> accept (SGLang's `verify_tree_greedy_triton`) ->
SGLang's C128 cleanup call -> commit (`_finalize_accept_tree_path` under the plug-in's hook,
calling `move_kv_cache`). `chain_round` runs the accepted path of one request as a linear
verify through the same code; `window_mask` names the pool elements of a range of a request's
positions (what a verify window may write), for the byte comparisons."""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
from sglang.kernels.ops.speculative.spec_tree import verify_tree_greedy_triton
from sglang.srt.layers.attention import deepseek_v4_backend as dsv4
from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool
from sglang.srt.speculative import eagle_worker_common as ewc

from dsv4_tree.attention.backend import get_backend
from dsv4_tree.serving.records import quantize_rows
from dsv4_tree.sglang_plugin import hooks
from dsv4_tree.sglang_plugin.backend import TreeDeepseekV4AttnBackend
from dsv4_tree.sglang_plugin.compressor import V4_RECORD
from dsv4_tree.sglang_plugin.metadata import tree_verify_metadata
from dsv4_tree.sglang_plugin.pool_bytes import StateRows
from dsv4_tree.sglang_plugin.scratch import ensure_scratch, pool_layers
from dsv4_tree.sglang_plugin.tables import depths, parents_from_retrieve
from sgl_cases import StandIn, layout, sglang_tree
from sgl_pool import LAYER_RATIOS, all_buffers, compressors, fill_random, make_pool, snapshot, swa_pack

VERIFY = SimpleNamespace(is_idle=lambda: False, is_target_verify=lambda: True)


@dataclass
class NodeInputs:
    """What the model produces for each verify node (a function of the node's path in a real
    model; drawn at random per node here, and the chain run takes the accepted nodes' rows)."""
    swa: torch.Tensor  # [T, 584] uint8 SWA record per node
    kv_score: list  # per compressor: [T, width] float32

    def rows(self, index: torch.Tensor) -> "NodeInputs":
        return NodeInputs(self.swa[index], [k[index] for k in self.kv_score])

    @staticmethod
    def draw(t: int, comps: list, gen: torch.Generator) -> "NodeInputs":
        data, scales = quantize_rows(torch.randn(t, 512, generator=gen), V4_RECORD)
        kv = [torch.randn(t, 2 * (2 if c.ratio == 4 else 1) * c.head_dim, generator=gen) for c in comps]
        return NodeInputs(torch.cat([data, scales], dim=1), kv)


class Case:
    """Two pools with the same random committed state (tree run, chain run), one layout."""

    def __init__(self, lens, gen, n: int, max_len: int = 1024):
        self.req_to_token, self.mapping = layout(lens, n, gen, extra_rows=1, max_len=max_len)
        pages = self.req_to_token.shape[0] * (max_len // 256) + 1
        self.pools = []
        for _ in range(2):
            pool = make_pool(pages, self.req_to_token.shape[0], self.mapping)
            fill_random(pool, torch.Generator().manual_seed(gen.initial_seed()))
            before = snapshot(pool)
            ensure_scratch(pool, n)
            for k, v in all_buffers(pool).items():  # growing keeps every existing byte
                assert torch.equal(v[: before[k].shape[0]], before[k]), k
            self.pools.append(pool)
        self.tree_pool, self.chain_pool = self.pools
        self.comps = compressors(torch.Generator().manual_seed(gen.initial_seed() + 1))


def verify_writes(pool, req_to_token, mapping, rpi, seq_lens, rn, rs, inputs: NodeInputs, comps, ops, meta=None):
    """A tree verify's writes: metadata (tree_verify_metadata, or `meta` when given: the replayed
    one), every node's SWA record through the pool's setter, every compressor through the tree
    backend. -> (out_cache_loc [bs*N], the verify's TreeDSV4Metadata)."""
    bs, n = rn.shape
    out_loc = torch.cat([req_to_token[r, p:p + n] for r, p in zip(rpi.tolist(), seq_lens.tolist())]).to(torch.int64)
    sb = StandIn(req_to_token, mapping, n)
    sb.token_to_kv_pool = pool
    raw = dsv4.DSV4RawVerifyMetadata(req_pool_indices=rpi, seq_lens=seq_lens, out_cache_loc=out_loc)
    backend = object.__new__(TreeDeepseekV4AttnBackend)
    backend.token_to_kv_pool, backend.req_to_token, backend._tree_ops = pool, req_to_token, ops
    backend.forward_metadata = tree_verify_metadata(sb, raw, rn, rs) if meta is None else meta
    swa_loc = pool.translate_loc_from_full_to_swa(out_loc)
    for layer in range(len(LAYER_RATIOS)):
        pool.set_swa_key_buffer(layer, swa_loc, swa_pack(inputs.swa))
    batch = SimpleNamespace(forward_mode=VERIFY)
    for c, kv in zip(comps, inputs.kv_score):
        run = backend.forward_indexer_compressor if c.is_in_indexer else backend.forward_core_compressor
        run(kv, batch, c.layer_id, c)
    return out_loc, backend.forward_metadata


def greedy_accept(rn, rs, target_child: torch.Tensor, steps: int):
    """SGLang's greedy tree acceptance. Node i's draft token is 1000 + i; the target predicts the
    token of child target_child[b, i] (-1: a token no child has). -> accept_index [bs, steps + 1]
    int32 (global node ids), accept_lens [bs] (path length, root included)."""
    bs, n = rn.shape
    cand = (1000 + torch.arange(n)).expand(bs, n).contiguous()
    target = torch.where(target_child >= 0, 1000 + target_child, torch.full_like(target_child, 7)).to(torch.int64)
    predicts = torch.zeros(bs * n, dtype=torch.int32)
    accept_index = torch.full((bs, steps + 1), -1, dtype=torch.int32)
    num = torch.zeros(bs, dtype=torch.int32)
    rindex = (torch.arange(bs).view(-1, 1) * n + torch.arange(n)).to(torch.int64)
    verify_tree_greedy_triton(predicts, accept_index, num, cand, rindex, rn.to(torch.int64), rs.to(torch.int64), target)
    return accept_index, num + 1


def commit(pool, rpi, seq_lens, rn, rs, out_loc, accept_index, accept_lens):
    """SGLang's order after acceptance: the pool's C128 cleanup call, then the tree path's
    finalize (hooked) with SGLang's own `_finalize_accept_tree_path` as the original."""
    bs, n = rn.shape
    hooks.around_clear_unaccepted_c128_draft_states(DeepSeekV4TokenToKVPool.clear_unaccepted_c128_draft_states,
                                                    pool, rpi, seq_lens, accept_lens, n)
    batch = SimpleNamespace(seq_lens=seq_lens, out_cache_loc=out_loc, req_pool_indices=rpi,
                            spec_info=SimpleNamespace(retrieve_next_token=rn, retrieve_next_sibling=rs))
    allocator = SimpleNamespace(get_kvcache=lambda: pool)
    return hooks.around_finalize_accept_tree_path(
        ewc._finalize_accept_tree_path, batch, accept_index, accept_lens, torch.zeros(bs * n, dtype=torch.int32),
        SimpleNamespace(hidden_states=None), bs, token_to_kv_pool_allocator=allocator, num_draft_tokens=n)


def chain_links(n: int):
    nxt = torch.arange(1, n + 1).masked_fill(torch.arange(n) == n - 1, -1).view(1, n)
    return nxt, torch.full((1, n), -1)


def accepted_nodes(accept_index, accept_lens, n: int) -> list:
    return [[int(a) - b * n for a in accept_index[b, : int(accept_lens[b])]] for b in range(accept_index.shape[0])]


def chain_round(pool, req_to_token, mapping, rid: int, p: int, path_inputs: NodeInputs, comps, ops) -> None:
    """A linear verify of one request's accepted path (L nodes) and its commit, same code."""
    L = path_inputs.swa.shape[0]
    rn, rs = chain_links(L)
    rpi, seq = torch.tensor([rid], dtype=torch.int32), torch.tensor([p], dtype=torch.int32)
    out_loc, _ = verify_writes(pool, req_to_token, mapping, rpi, seq, rn, rs, path_inputs, comps, ops)
    commit(pool, rpi, seq, rn, rs, out_loc, torch.arange(L, dtype=torch.int32).view(1, L),
           torch.tensor([L], dtype=torch.int32))


def window_mask(pool, req_to_token, spans, scratch: bool = True) -> dict:
    """spans: [(req_pool_index, lo, hi)] -> buffer name -> flat bool mask of every element that
    belongs to positions lo..hi-1 of that request (SWA records, C4 state rows of their SWA slots,
    C128 state rows, the entry homes of blocks closing there), the trash entry slot, plus (scratch)
    every scratch entry slot."""
    bufs = all_buffers(pool)
    masks = {k: torch.zeros(v.numel(), dtype=torch.bool) for k, v in bufs.items()}
    slots_of = pool.dsv4_tree_scratch

    def mark(name, target, idx):
        if idx.numel():
            masks[name][target.element_index(idx).view(-1)] = True

    for layer, lb in enumerate(pool_layers(pool)):
        for rid, lo, hi in spans:
            pos = torch.arange(lo, hi)
            slots = req_to_token[rid, pos].to(torch.int64)
            swa = pool.translate_loc_from_full_to_swa(slots)
            mark(f"swa.{layer}", lb.swa, swa)
            for name, sp in ((f"state.{layer}", lb.state), (f"index_state.{layer}", lb.index_state)):
                if sp is None:
                    continue
                rows = (sp.translate_from_swa_loc_to_state_loc(swa.clone()) if sp.ratio == 4 else
                        sp.translate_from_req_position_to_state_loc(torch.full_like(pos, rid), pos.clone()))
                mark(name, StateRows(sp.kv_score_buffer.kv_score), rows)
            if lb.ratio:
                m = lb.ratio
                homes = slots[(pos + 1) % m == 0] // m
                item = pool.layer_mapping[layer]
                mark(f"c{m}.{item.compress_layer_id}", lb.entries, homes)
                if lb.index_keys is not None:
                    mark(f"index{m}.{item.compress_layer_id}", lb.index_keys, homes)
        if lb.ratio:
            m = lb.ratio
            item = pool.layer_mapping[layer]
            # the trash slot (every verify's rows that close no block write it; nothing reads it), and
            # with scratch, every scratch slot
            first = slots_of.start[m] if scratch else slots_of.trash(m)
            for name, target in ((f"c{m}.{item.compress_layer_id}", lb.entries),
                                 (f"index{m}.{item.compress_layer_id}", lb.index_keys)):
                if target is not None:
                    mark(name, target, torch.arange(first, slots_of.trash(m) + 1))
    return masks


def unchanged(before: dict) -> dict:
    """Masks excluding nothing: with differing(), every element of every snapshot compared."""
    return {k: torch.zeros(v.numel(), dtype=torch.bool) for k, v in before.items()}


def differing(a: dict, b: dict, masks: dict) -> dict:
    """name -> count of elements outside masks[name] whose bits differ between snapshots a and b."""
    out = {}
    for k in a:
        x, y = a[k].reshape(-1), b[k].reshape(-1)
        if x.dtype == torch.float32:
            x, y = x.view(torch.int32), y.view(torch.int32)
        diff = (x != y) & ~masks[k]
        if bool(diff.any()):
            out[k] = int(diff.sum())
    return out


def depth_of(rn, rs) -> torch.Tensor:
    return depths(parents_from_retrieve(rn, rs))


def random_targets(rn, rs, gen, last_child: bool):
    """target_child [bs, N]: per node one of its children (the last one when last_child, so
    siblings other than the first get accepted), or -1 now and then."""
    parents = parents_from_retrieve(rn, rs)
    bs, n = parents.shape
    out = torch.full((bs, n), -1, dtype=torch.int64)
    for b in range(bs):
        for i in range(n):
            kids = [j for j in range(n) if int(parents[b, j]) == i]
            if kids and float(torch.rand(1, generator=gen)) < 0.85:
                out[b, i] = kids[-1] if last_child else kids[int(torch.randint(len(kids), (1,), generator=gen))]
    return out


def tree_ready(case, gen, lens, rpi, n, topk=3, steps=3):
    """A tree verify's writes on case.tree_pool and SGLang's greedy acceptance of it (siblings
    favoured), ready to commit."""
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    _, rn, rs = sglang_tree(len(lens), topk, steps, n, seq_lens, gen)
    inputs = NodeInputs.draw(len(lens) * n, case.comps, gen)
    ops = get_backend("torch")
    out_loc, _ = verify_writes(case.tree_pool, case.req_to_token, case.mapping, rpi, seq_lens, rn, rs, inputs,
                               case.comps, ops)
    accept_index, accept_lens = greedy_accept(rn, rs, random_targets(rn, rs, gen, True), steps)
    return seq_lens, rn, rs, out_loc, accept_index, accept_lens, inputs
