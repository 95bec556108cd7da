"""The launches the library makes, recorded as KernelSpecs (under TRITON_INTERPRET=1).

    specs = record(SCENARIOS["flash-verify"])     # [(KernelSpec, scenario label)]

A scenario builds a model with the attention dimensions of a model size (3 decoder layers:
sliding, C4 with the indexer, C128), a Triton-backend engine over FP8 pools, synthetic committed
requests (serving.synth) and EAGLE-shaped trees, and runs the verify step and a commit (and for
`prefill`, a chunked prefill) inside a LaunchRecorder. The numeric kernels are recorded and not
run (record.py says why that gives the same specs), so V4-Flash / V4-Pro shapes take seconds.

    tiny          the tiny test config (fp32): verify N = 8 tree at bs 1 and 2, commit
    tiny-prefill  the tiny config: a prefill of 40 tokens in 16-row chunks
    flash-verify  V4-Flash dims, bf16: verify N = 8, bs 1, 1024 C4 entries (KP = 1024), commit
    flash-more    V4-Flash: N = 8 at bs 2, N = 16 and 64 at bs 1, N = 8 at a 64K context
    flash-prefill V4-Flash: prefill of 600 tokens in 256-row chunks and 200 in 64-row chunks; 256
                  and 64 rows at a 2100-token context (KP = 1024)
    pro           V4-Pro dims (128 heads, top-k 1024): verify N = 8 at bs 1 and 2 (KP = 2048), a prefill
                  in 256-row chunks, and 256 rows at an 8400-token context (KP = 2048, 16-row tiles)
    extra         kernels outside the Triton verify step at V4-Flash dims: the SGLang plug-in's
                  pool_entries (C4 and C128 compressors, SGLang's fp32 kv_score) and
                  indexer_gather / indexer_paged scores
    tiny-rules, flash-rules, pro-rules
                  what the library's launch rules give (launch_rules.py): "auto" and FP8 pools,
                  verify bucketed as on CUDA at every batch bucket up to max_requests and N 1 to
                  64, prefill chunks and their tails
    flash-sample  the subset of flash-rules the coverage test holds a public run to (nightly)
"""
from __future__ import annotations

from .launch_rules import rule_steps
from .record import LaunchRecorder
from .steps import Prefill, Scenario, Verify

_COMPRESS = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
_SMALL_MOE = dict(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=256)

FLASH = dict(vocab_size=1024, hidden_size=4096, num_attention_heads=64, num_key_value_heads=1, head_dim=512,
             partial_rotary_factor=64 / 512, q_lora_rank=1024, o_groups=8, o_lora_rank=1024, sliding_window=128,
             index_n_heads=64, index_head_dim=128, index_topk=512, hc_mult=4, compress_rates=_COMPRESS,
             max_position_embeddings=1 << 21, **_SMALL_MOE)
PRO = dict(FLASH, hidden_size=7168, num_attention_heads=128, q_lora_rank=1536, o_groups=16, index_topk=1024)


SCENARIOS = {
    "tiny": Scenario("tiny", (Verify(8, (40,)), Verify(8, (40, 53)))),
    "tiny-prefill": Scenario("tiny", (Prefill(40, 16),)),
    "flash-verify": Scenario("flash", (Verify(8, (4200,)),)),
    "flash-more": Scenario("flash", (Verify(8, (4200, 4253)), Verify(16, (4200,)), Verify(64, (4200,)),
                                     Verify(8, (65549,)))),
    "flash-prefill": Scenario("flash", (Prefill(600, 256), Prefill(200, 64), Verify(256, (2100,)), Verify(64, (2100,)))),
    "pro": Scenario("pro", (Verify(8, (8400,)), Verify(8, (8400, 8413)), Prefill(300, 256), Verify(256, (8400,)))),
    "extra": Scenario("flash", (), extra=True),
}
# derived from the library's launch rules (launch_rules.py): defaults, buckets, both pools
SCENARIOS.update({f"{dims}-rules": Scenario(dims, rule_steps(dims)) for dims in ("tiny", "flash", "pro")})
SCENARIOS["flash-sample"] = Scenario("flash", rule_steps("flash", sample=True))
QUICK = ("tiny", "flash-verify")  # the normal suite's gate
RULES = ("tiny-rules", "flash-rules", "pro-rules")  # hundreds of steps: recorded and compiled nightly under 3.9
FULL = tuple(n for n in SCENARIOS if n not in RULES)  # `slow` under every Triton / scripts/aot_gate --full


def model_for(dims: str, dtype=None, device: str = "cpu", weights: str = "random"):
    """The model a scenario runs at `dims`; weights "random" (seeded) or "zeros" (recording: no
    value reaches a spec, checkpoint/tiny.py zero_model)."""
    import torch

    import dsv4_tree as dt
    from dsv4_tree.checkpoint.tiny import random_model, zero_model

    if dims == "tiny":
        cfg = dt.tiny_config(vocab_size=1024)
        dtype = dtype or torch.float32
    else:
        kinds = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
        cfg = dt.tiny_config(**(FLASH if dims == "flash" else PRO), num_hidden_layers=3, layer_types=kinds,
                             mlp_layer_types=["moe"] * 3)
        dtype = dtype or torch.bfloat16
    hf = zero_model(cfg) if weights == "zeros" else random_model(cfg, seed=0)
    return dt.load_model(hf, device=device, dtype=dtype)


def _engine(model, n: int, chunk: int, max_context: int, pools: str = "fp8_e4m3", max_requests: int = 2,
            bucketed: bool = False):
    import dsv4_tree as dt

    spec = dt.SpecConfig(eagle_topk=4, num_steps=max(2, n), num_draft_tokens=n, prefill_chunk=chunk,
                         max_requests=max_requests, max_total_tokens=max_context + 2048 * max_requests,
                         kv_cache_dtype=pools, page_size=256, attention_backend="triton",
                         cuda_graph_max_bs=max_requests if bucketed else None)
    return dt.Engine(model, spec)


def _run_step(model, step) -> None:
    import torch

    from dsv4_tree.serving.synth import synthetic_request
    from dsv4_tree.tree import DraftTree
    from dsv4_tree.tree.simulate import eagle_tree

    if isinstance(step, Prefill):
        eng = _engine(model, step.n, step.chunk, step.length * step.prompts, step.pools,
                      max(step.max_requests, step.prompts))
        g = torch.Generator().manual_seed(step.length)
        reqs = eng.prefill_batch([torch.randint(2, 1000, (step.length,), generator=g) for _ in range(step.prompts)])
        for r in reqs:
            eng.release(r)
        return
    eng = _engine(model, step.n, 64, sum(step.contexts), step.pools, max(step.max_requests, len(step.contexts)),
                  step.bucketed)
    reqs = [synthetic_request(eng, p, seed=p) for p in step.contexts]
    trees = [eagle_tree(5, step.n, seed=i) if step.n <= 64 else DraftTree.chain([5] + [7] * (step.n - 1))
             for i in range(len(reqs))]
    out = eng.verify(reqs, trees)
    eng.commit(reqs, eng.accept_greedy(reqs, trees, out), out)
    for r in reqs:
        eng.release(r)


def plugin_pool_entries(device: str = "cpu", weight_dtypes=None) -> None:
    """pool_entries as the SGLang plug-in calls it (sglang_plugin/compressor.py): SGLang's fp32
    kv_score rows through `gate_and_kv` (with the ape bias), at the C4 (2 x 4 rows) and C128
    (128 rows) compressors of the attention (head_dim 512) and the indexer (128), with a norm
    weight of each of `weight_dtypes` (default bf16, a bf16 model's, and fp32)."""
    import torch

    from types import SimpleNamespace

    from dsv4_tree import kernels
    from dsv4_tree.sglang_plugin.compressor import gate_and_kv

    z = dict(device=device)
    for d in (512, 128):
        for ratio in (4, 128):
            w_rows = 2 * ratio if ratio == 4 else ratio
            src = torch.zeros(3, w_rows, (4 if ratio == 4 else 2) * d, dtype=torch.float32, **z)  # kv_score rows
            pos = torch.arange(w_rows, **z).expand(3, w_rows) - 2  # two null rows (before position 0)
            kv, gate = gate_and_kv(src, pos, ratio, d, torch.zeros(w_rows, d, dtype=torch.bfloat16, **z))
            for wdt in weight_dtypes or (torch.bfloat16, torch.float32):
                norm = SimpleNamespace(weight=torch.ones(d, dtype=wdt, **z), variance_epsilon=1e-6)
                kernels.pool_entries(kv, gate, norm, None, None, lambda x, cos, sin: x)


def _run_extra(device: str = "cpu") -> None:
    """The plug-in's pool_entries (plugin_pool_entries) and the gather / paged indexer scores at
    V4-Flash's 64 x 128 index heads."""
    import torch

    from dsv4_tree import kernels
    from dsv4_tree.serving import KVPool

    z = dict(device=device)
    plugin_pool_entries(device)
    keys = KVPool(64, 128, 0, "fp8_e4m3", 16, device, torch.bfloat16, kind="index_key")
    q = torch.zeros(8, 64, 128, dtype=torch.bfloat16, **z)
    w = torch.zeros(8, 64, dtype=torch.float32, **z)
    kernels.indexer_gather_scores(q, w, keys, torch.zeros(8, 32, dtype=torch.int64, **z), 128 ** -0.5)
    req_rows = torch.arange(8, dtype=torch.int32, **z).view(1, 8)
    kernels.indexer_paged_scores(q, w, keys, torch.zeros(1, 4, dtype=torch.int32, **z), 16,
                                 torch.tensor([40], dtype=torch.int32, **z), req_rows, torch.arange(8, **z), 128 ** -0.5)


def record(names, progress=None) -> list:
    """[(KernelSpec, scenario label)], distinct specs in first-seen order, over the named scenarios."""
    seen: dict = {}
    models: dict = {}
    for name in names:
        sc = SCENARIOS[name]
        with LaunchRecorder(where=name) as rec:
            if sc.extra:
                _run_extra()
            else:
                if sc.dims not in models:
                    models.clear()
                    models[sc.dims] = model_for(sc.dims, weights="zeros")
                for step in sc.steps:
                    _run_step(models[sc.dims], step)
        for key, r in rec.seen.items():
            seen.setdefault(key, (r.spec, name))
        if progress is not None:
            progress(name, len(rec.seen), rec.launches)
    return list(seen.values())


def launch(names, device: str = "cuda", progress=None) -> None:
    """Run the named scenarios with every kernel compiled and launched on `device` (a GPU; no
    recording, no interpreter): the same shapes the gate compiled, each launched once for real."""
    import torch

    for name in names:
        sc = SCENARIOS[name]
        if sc.extra:
            _run_extra(device)
        else:
            model = model_for(sc.dims, device=device)
            for step in sc.steps:
                _run_step(model, step)
            del model
        torch.cuda.synchronize()
        if progress is not None:
            progress(name)
