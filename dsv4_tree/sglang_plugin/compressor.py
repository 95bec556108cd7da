"""Tree verify's compressor writes in SGLang 0.5.23's DeepSeek-V4 pools: each closing node's
compressed entry (or C4 indexer key) from its own root-to-node path, with dsv4-tree's branch
compressor (`AttentionOps.pool_entries`: the Triton kernel or the torch backend).

SGLang's compressor plans address state rows by position, so siblings (one position, several
nodes) would share rows. Here, per call (one layer, one compressor):

1. Source rows of every closing row t (its block of m positions; C4: 2m, the previous block's
   overlap half, then its own half): positions before P from SGLang's state ring at SGLang's
   committed rows (C4: `translate_from_swa_loc_to_state_loc` of the position's SWA slot; C128:
   `req * ring + pos % ring`), positions P.. from the verify input `kv_score` of the row's
   ancestor at that depth. Positions before 0 are null rows (kv 0, score -inf).
2. Entry = RMSNorm(sum softmax(score + ape) * kv) (`pool_entries`), RoPE at the block start
   (SGLang's `freqs_cis`, interleaved pairs on the trailing 64 channels); indexer keys are then
   Hadamard-rotated. The row is quantised with dsv4-tree's codec (`serving.records`: FlashMLA's
   V4 record, the FP8 indexer-key record) and stored through the pool's own setters
   (`set_extra_key_buffer`, `set_index_k_scale_buffer`) at `c{m}_out_loc[t]` (home or scratch).
3. Every node's raw `kv_score` row is then written to a state row of its own: C4 at SGLang's
   row for the node's token slot (distinct per node), C128 at `req * ring + (P + i) % ring` (the
   node's slot index i, not its depth). Commit moves accepted rows to their depth's rows.
Reading before writing keeps step 1 independent of what step 3 overwrites. Fixed shape, no host
read (it runs inside SGLang's captured verify graph): every row is computed as if it closed a
block, and the rows that close none store their entry in the scratch's trash slot
(`TreeScratch.trash`), as the engine's compressor does; the ancestor table comes with the
verify's tables."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from ..numerics.hadamard import hadamard_rotate
from ..numerics.rope import apply_rope, rope_pairs
from ..serving.records import IndexKeyLayout, RecordLayout, quantize_rows
from .tables import TreeVerifyTables

V4_RECORD = RecordLayout(head_dim=512, rope_dim=64)
INDEX_KEY = IndexKeyLayout(dim=128)


class _Norm:
    """SGLang's RMSNorm parameters as `pool_entries` reads them (weight, variance_epsilon; called
    by the torch backend): x * rsqrt(mean(x^2) + eps) * weight in fp32."""

    def __init__(self, norm):
        self.weight = norm.weight
        self.variance_epsilon = float(norm.variance_epsilon)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.variance_epsilon).to(x.dtype)


@dataclass(frozen=True)
class TreeRows:
    """Per-request columns of one tree verify (bs requests, N nodes each), from its tables."""
    prefix: torch.Tensor  # [bs] int64, P (committed positions)
    req: torch.Tensor  # [bs] int64, req_pool_index
    n: int

    @staticmethod
    def of(tables: TreeVerifyTables) -> "TreeRows":
        bs, n = tables.depth.shape
        first = torch.arange(bs, device=tables.depth.device) * n  # node 0 (the root, depth 0) of each request
        prefix = tables.seq_lens_casual.to(torch.int64)[first] - 1
        return TreeRows(prefix, tables.req_pool_indices_repeated.to(torch.int64)[first], n)


def committed_state_rows(state_pool, ratio: int, req_to_token, full_to_swa, req, positions) -> torch.Tensor:
    """SGLang's state rows of committed positions [E, W] (position >= 0) of requests req [E, 1]."""
    if ratio == 4:
        tokens = req_to_token[req.expand_as(positions), positions].to(torch.int64)
        return state_pool.translate_from_swa_loc_to_state_loc(full_to_swa[tokens].to(torch.int64))
    return state_pool.translate_from_req_position_to_state_loc(req.expand_as(positions), positions)


def node_state_rows(state_pool, ratio: int, rows: TreeRows, out_cache_loc, full_to_swa) -> torch.Tensor:
    """[bs * N] int64: the state row each verify node writes (see the module note, step 3)."""
    if ratio == 4:
        return state_pool.translate_from_swa_loc_to_state_loc(full_to_swa[out_cache_loc.to(torch.int64)].to(torch.int64))
    n = rows.n
    node = torch.arange(n, device=rows.prefix.device)
    pos = (rows.prefix.view(-1, 1) + node).reshape(-1)
    return state_pool.translate_from_req_position_to_state_loc(rows.req.repeat_interleave(n), pos)


def _rope_tables(freqs_cis: torch.Tensor, positions: torch.Tensor):
    if not torch.is_complex(freqs_cis):
        raise ConfigError(f"dsv4_tree tree compressor: freqs_cis must be SGLang's complex table, got {freqs_cis.dtype}")
    f = freqs_cis[positions.to(torch.int64)]  # [E, rope_dim / 2]
    return rope_pairs(f.real.float().unsqueeze(0), f.imag.float().unsqueeze(0))


def source_rows(tables: TreeVerifyTables, rows: TreeRows, ratio: int, ring: torch.Tensor, kv_score: torch.Tensor,
                ring_rows_of) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (rows [T, W, last_dim] fp32, positions [T, W]) of every verify row, as if it closed a
    block (W = 2m (C4) or m): committed positions from the ring, verify positions from kv_score
    along the row's path. Fixed shape: rows that close nothing are computed and discarded."""
    n = rows.n
    width = 2 * ratio if ratio == 4 else ratio
    lens = tables.seq_lens_casual.to(torch.int64).view(-1, 1)
    pos = lens - width + torch.arange(width, device=lens.device)  # [T, W]
    t = lens.shape[0]
    b = torch.arange(t, device=lens.device) // n
    P = rows.prefix[b].view(-1, 1)
    depth = tables.depth.reshape(-1, 1)
    up = (depth - (pos - P)).clamp(0, n - 1)  # how far up the path position pos sits
    node = tables.ancestors.reshape(t, n).gather(1, up)
    from_input = kv_score[(b.view(-1, 1) * n + node.clamp_min(0)).view(-1)].view(*pos.shape, -1).float()
    ring_idx = ring_rows_of(rows.req[b].view(-1, 1), pos.clamp_min(0))
    from_ring = ring[ring_idx.clamp_min(0).view(-1)].view(*pos.shape, -1).float()
    out = torch.where((pos < P).unsqueeze(-1), from_ring, from_input)
    return out, pos


def gate_and_kv(src: torch.Tensor, pos: torch.Tensor, ratio: int, head_dim: int, ape: torch.Tensor):
    """SGLang's row layout -> kv, gate [E, W, head_dim] with the ape bias added; null rows (pos < 0)
    get kv 0 and gate -inf. C4 rows are [kv overlap | kv | score overlap | score]: the previous
    block's rows contribute their overlap halves, the block's own rows the other halves."""
    d = head_dim
    bias = ape.reshape(-1, d).float()  # [W, d]: SGLang's `ape.view(-1, head_dim)`
    if ratio == 4:
        m = ratio
        kv = torch.cat([src[:, :m, 0:d], src[:, m:, d:2 * d]], dim=1)
        score = torch.cat([src[:, :m, 2 * d:3 * d], src[:, m:, 3 * d:4 * d]], dim=1)
    else:
        kv, score = src[..., :d], src[..., d:2 * d]
    null = (pos < 0).unsqueeze(-1)
    return kv.masked_fill(null, 0.0), (score + bias).masked_fill(null, float("-inf"))


def store_entries(pool, layer_id: int, is_indexer: bool, loc: torch.Tensor, entries: torch.Tensor) -> None:
    """Quantise entries [E, d] and store them at loc [E] through the pool's own setters."""
    from sglang.kernels.ops.kvcache.dsv4_main_kv_store import NopeFp8RopeBf16Pack

    if is_indexer:
        data, scales = quantize_rows(entries, INDEX_KEY)
        pool.set_index_k_scale_buffer(layer_id, loc, data.view(torch.float8_e4m3fn),
                                      scales.contiguous().view(torch.float32))
        return
    data, scales = quantize_rows(entries, V4_RECORD)
    nope = V4_RECORD.nope_dim
    pack = NopeFp8RopeBf16Pack(data[:, :nope].contiguous().view(torch.float8_e4m3fn),
                               data[:, nope:].contiguous().view(torch.bfloat16),
                               scales[:, :V4_RECORD.n_tiles].contiguous())
    pool.set_extra_key_buffer(layer_id, loc, pack)


def tree_compress(*, pool, req_to_token: torch.Tensor, tables: TreeVerifyTables, out_cache_loc: torch.Tensor,
                  compressor, kv_score: torch.Tensor, layer_id: int, ops) -> None:
    """One compressor's writes for a tree verify (the module note's steps 1-3).
    compressor: SGLang's Compressor (ratio, head_dim, ape, norm, freqs_cis, rotate,
    is_in_indexer); kv_score [bs * N, 2 * (1 + overlap) * head_dim] its `compute_kv_score`."""
    ratio, d = int(compressor.ratio), int(compressor.head_dim)
    if ratio not in (4, 128):
        raise ConfigError(f"dsv4_tree tree compressor: ratio {ratio} (layer {layer_id}) is not 4 or 128")
    expect = 128 if compressor.is_in_indexer else 512
    if d != expect or compressor.rotate != compressor.is_in_indexer:
        raise ConfigError(f"dsv4_tree tree compressor: head_dim {d}, rotate {compressor.rotate} for "
                          f"{'an indexer' if compressor.is_in_indexer else 'a KV'} compressor (expected {expect})")
    state_pool = (pool.get_indexer_compress_states(layer_id) if compressor.is_in_indexer
                  else pool.get_attention_compress_states(layer_id))
    ring = state_pool.kv_score_buffer.kv_score
    if kv_score.shape[-1] != ring.shape[-1]:
        raise ConfigError(f"dsv4_tree tree compressor: kv_score rows of {kv_score.shape[-1]} values, state rows "
                          f"of {ring.shape[-1]} (layer {layer_id}, ratio {ratio})")
    full_to_swa = pool.full_to_swa_index_mapping
    scratch = pool.dsv4_tree_scratch
    rows = TreeRows.of(tables)
    ring_rows_of = lambda req, pos: committed_state_rows(state_pool, ratio, req_to_token, full_to_swa,  # noqa: E731
                                                         req, pos)
    src, pos = source_rows(tables, rows, ratio, ring, kv_score, ring_rows_of)
    kv, gate = gate_and_kv(src, pos, ratio, d, compressor.ape)
    lens = tables.seq_lens_casual.to(torch.int64)
    cos, sin = _rope_tables(compressor.freqs_cis, (lens - ratio).clamp_min(0))  # the block's start
    entries = ops.pool_entries(kv, gate, _Norm(compressor.norm), cos, sin, apply_rope).float()
    if compressor.rotate:
        entries = hadamard_rotate(entries)
    out_loc = tables.c4_out_loc if ratio == 4 else tables.c128_out_loc
    closes = lens % ratio == 0
    store_entries(pool, layer_id, compressor.is_in_indexer, torch.where(closes, out_loc, scratch.trash(ratio)), entries)
    ring[node_state_rows(state_pool, ratio, rows, out_cache_loc, full_to_swa)] = kv_score.to(ring.dtype)
