"""The physical floor of one verify step on an H200: max(bytes / 4.3 TB/s, FLOPs / 790 TFLOP/s).

Bytes: the weights once (bf16, embeddings excluded: a step reads T of their rows) plus the KV a
step must read: per row and layer its window's K=V records, on C4 layers its top-k picked
entries, and per request and C4 layer every committed indexer key, per request and C128 layer
every committed entry (read once per request: a request's rows share them). FLOPs: 2 x weights
x rows (every expert counted: an upper bound of the dense work at this model's tiny MoE), plus
attention (QK and PV over each row's keys) and indexer scores (each row against every key)."""
from __future__ import annotations

from dataclasses import dataclass

HBM_BYTES_PER_S = 4.3e12  # H200 HBM3e
BF16_FLOPS = 790e12  # H200 bf16 dense tensor-core rate used for the floor (~790 TFLOP/s)


@dataclass(frozen=True)
class Floor:
    weights_s: float
    kv_s: float
    flops_s: float

    @property
    def seconds(self) -> float:
        return max(self.weights_s + self.kv_s, self.flops_s)


def record_bytes(pool) -> int:
    return pool.bytes_per_token


def step_floor(engine, contexts, rows_per_request) -> Floor:
    """contexts: committed P per request; rows_per_request: tree sizes."""
    model, cfg = engine.model, engine.model.config
    hf = model.hf
    weights = sum(p.numel() for n, p in hf.named_parameters() if "embed_tokens" not in n)
    rows = sum(rows_per_request)
    w, topk, h, d = cfg.sliding_window, cfg.index_topk, cfg.num_attention_heads, cfg.head_dim
    kv_bytes, flops = 0, 2 * weights * rows
    for lp in engine.runtime.pools:
        rec = record_bytes(lp.swa)
        keys_per_row = [w] * len(contexts)
        if lp.main is not None and lp.indexer is not None:  # C4: top-k picks, every indexer key
            ikey = record_bytes(lp.indexer.entries)
            for p, n in zip(contexts, rows_per_request):
                picks = min(topk, p // 4)
                kv_bytes += n * (w + picks) * rec + (p // 4) * ikey
                flops += n * 2 * cfg.index_n_heads * cfg.index_head_dim * (p // 4)
            keys_per_row = [w + min(topk, p // 4) for p in contexts]
        elif lp.main is not None:  # C128: every committed entry, once per request
            for p, n in zip(contexts, rows_per_request):
                kv_bytes += n * w * rec + (p // lp.main.ratio) * record_bytes(lp.main.entries)
            keys_per_row = [w + p // lp.main.ratio for p in contexts]
        else:
            kv_bytes += rows * w * rec
        flops += sum(n * 4 * h * d * k for n, k in zip(rows_per_request, keys_per_row))
    return Floor(2 * weights / HBM_BYTES_PER_S, kv_bytes / HBM_BYTES_PER_S, flops / BF16_FLOPS)
