"""A real SGLang 0.5.23 `DeepSeekV4TokenToKVPool` on the CPU, and a stand-in model step that writes
it the way SGLang's DeepSeek-V4 model does during a verify (SWA records through the pool's
`set_swa_key_buffer`, compressor calls through the tree backend's `forward_core_compressor` /
`forward_indexer_compressor`), for the write-side tests.

The pool needs SGLang's runtime context (its constructor reads the resolved exec / spec
settings): `published_context` resolves ServerArgs for a tiny local DeepSeek-V4 config with
EAGLE speculation (which gives the speculative state rings: C4 16 rows per SWA page, C128 256 per
request) and publishes it, restoring the previous context afterwards. With topk > 1 the published
spec carries that topk, as the plug-in's argument hooks leave it for a tree (SGLang alone refuses
topk > 1 for DeepSeek-V4, so it is set on the published context, SGLang's `override`); `make_pool` sizes the C4
state pool by the ring SGLang's `resolve_compress_state_ring_size` gives under that context (the
plug-in's ring hook, where a test applies it)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from types import SimpleNamespace

import torch

PAGE = 256
LAYER_RATIOS = [4, 128, 0]  # one C4 layer (with its indexer), one C128 layer, one SWA-only layer


@contextlib.contextmanager
def published_context(model_dir: str, num_draft_tokens: int, topk: int = 1):
    from sglang.srt import runtime_context as rc
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path=model_dir, skip_tokenizer_init=True, device="cpu", random_seed=0,
                      disable_cuda_graph=True, speculative_algorithm="EAGLE", speculative_eagle_topk=1,
                      speculative_num_steps=num_draft_tokens - 1, speculative_num_draft_tokens=num_draft_tokens)
    args.resolve_once()
    saved = rc.snapshot_context()
    rc.publish(args, role="scheduler")
    if topk != 1:
        rc.get_context().override("dsv4_tree test: a tree's topk", speculative_eagle_topk=topk)
    try:
        yield
    finally:
        rc.restore_context(saved)


def make_pool(num_full_pages: int, max_num_reqs: int, mapping: torch.Tensor, ratios=tuple(LAYER_RATIOS), **kw):
    """A DeepSeekV4TokenToKVPool for token slots [0, num_full_pages * 256) (page 0 reserved),
    an SWA pool of as many pages, one layer per entry of `ratios` (kw: more of the pool's
    constructor arguments)."""
    from sglang.srt.mem_cache import deepseek_v4_memory_pool as mp

    full = num_full_pages * PAGE
    c128 = full // 128
    c4_ring = mp.resolve_compress_state_ring_size(4)  # rows per SWA page (the configurator's sizing)
    pool = mp.DeepSeekV4TokenToKVPool(
        max_num_reqs=max_num_reqs, swa_size=full - PAGE, c4_size=full // 4, c128_size=c128,
        c4_state_pool_size=num_full_pages * c4_ring, c128_state_pool_size=(max_num_reqs + 1) * 256, page_size=PAGE,
        swa_page_size=PAGE, dtype=torch.float8_e4m3fn, c4_state_dtype=torch.float32, c128_state_dtype=torch.float32,
        qk_nope_head_dim=448, qk_rope_head_dim=64, indexer_head_dim=128, layer_num=len(ratios), device="cpu",
        enable_memory_saver=False, compression_ratios=list(ratios), **kw)
    pool.register_mapping(mapping)
    return pool


def fill_random(pool, gen: torch.Generator) -> None:
    """Random bytes everywhere, except the 8th scale byte of every V4 record (SGLang's writers
    store 7 ue8m0 bytes and never touch it: it stays 0 from allocation), and SGLang's empty
    sentinel row at the end of every state ring."""
    for name, buf in all_buffers(pool).items():
        if buf.dtype == torch.uint8:
            buf.copy_(torch.randint(0, 256, buf.shape, generator=gen, dtype=torch.uint8))
        else:
            buf.copy_(torch.randn(buf.shape, generator=gen))
    for owner in [pool.swa_kv_pool, *pool.kv_pools.values()]:
        pad = owner.page_size * 576 + torch.arange(owner.page_size) * 8 + 7
        for buf in owner.kv_buffer:
            buf[:, pad] = 0
    for sp in pool.compress_state_pools + pool.indexer_compress_state_pools:
        if sp is not None:
            sp.kv_score_buffer[-1].clear()


def all_buffers(pool) -> dict:
    """name -> every byte / state buffer of the pool (the tensors themselves)."""
    out = {}
    for i, buf in enumerate(pool.swa_kv_pool.kv_buffer):
        out[f"swa.{i}"] = buf
    for m, kv in pool.kv_pools.items():
        for i, buf in enumerate(kv.kv_buffer):
            out[f"c{m}.{i}"] = buf
    for m, idx in pool.index_pools.items():
        for i, buf in enumerate(idx.index_k_with_scale_buffer):
            out[f"index{m}.{i}"] = buf
    for name, pools in (("state", pool.compress_state_pools), ("index_state", pool.indexer_compress_state_pools)):
        for layer, sp in enumerate(pools):
            if sp is not None:
                out[f"{name}.{layer}"] = sp.kv_score_buffer.kv_score
    return out


def snapshot(pool) -> dict:
    return {k: v.clone() for k, v in all_buffers(pool).items()}


@dataclass
class LayerWeights:
    """A stand-in for SGLang's Compressor: the attributes the backend's compressor path reads;
    compute_kv_score returns its input (the model's kv_score rows, drawn by the test)."""
    ratio: int
    head_dim: int
    is_in_indexer: bool
    layer_id: int
    ape: torch.Tensor
    norm: SimpleNamespace
    freqs_cis: torch.Tensor

    @property
    def rotate(self) -> bool:
        return self.is_in_indexer

    @staticmethod
    def compute_kv_score(x, forward_batch):
        return x

    @staticmethod
    def draw(ratio: int, head_dim: int, is_in_indexer: bool, layer_id: int, gen: torch.Generator) -> "LayerWeights":
        coff = 2 if ratio == 4 else 1
        ape = torch.randn(ratio, coff * head_dim, generator=gen) * 0.5
        norm = SimpleNamespace(weight=1 + 0.1 * torch.randn(head_dim, generator=gen), variance_epsilon=1e-6)
        pos = torch.arange(4096, dtype=torch.float32).view(-1, 1)
        inv = 10000.0 ** (-torch.arange(0, 64, 2, dtype=torch.float32) / 64)
        freqs = torch.polar(torch.ones(4096, 32), pos * inv)  # SGLang's complex freqs_cis layout [pos, 32]
        return LayerWeights(ratio, head_dim, is_in_indexer, layer_id, ape, norm, freqs)


def compressors(gen: torch.Generator) -> list:
    """(layer_id, LayerWeights) of every compressor of LAYER_RATIOS."""
    out = []
    for layer, m in enumerate(LAYER_RATIOS):
        if m:
            out.append(LayerWeights.draw(m, 512, False, layer, gen))
        if m == 4:
            out.append(LayerWeights.draw(m, 128, True, layer, gen))
    return out


def swa_pack(records: torch.Tensor):
    """[n, 584] uint8 records -> SGLang's NopeFp8RopeBf16Pack."""
    from sglang.kernels.ops.kvcache.dsv4_main_kv_store import NopeFp8RopeBf16Pack

    return NopeFp8RopeBf16Pack(records[:, :448].contiguous().view(torch.float8_e4m3fn),
                               records[:, 448:576].contiguous().view(torch.bfloat16),
                               records[:, 576:583].contiguous())
