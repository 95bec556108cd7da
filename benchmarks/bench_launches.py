"""Kernel launches of one verify step (device table build + forward + commit), by owner, for
the torch and the Triton backend: what a GPU would launch, counted on CPU or the meta device.

The model is bench_verify's (three layers: SWA, C4 + indexer, C128; bf16; FP8 pools); every
request sits at P = context + (13 b mod 64) with its own eagle_tree(5, N = 8, topk 4), and the
step commits each tree's deepest path. Counting uses dsv4_tree.diagnostics.LaunchCounter: aten
ops that launch a kernel plus every Triton launch. Requests are adopted without writing their
rows (the pools keep zeros): no op of a step reads a value on the host, so the counts do not
depend on the data.

  --device meta  the torch backend at V4-Flash shapes (the GPU's code path, no memory)
  --device cpu   both backends at the tiny shapes (Triton under TRITON_INTERPRET=1: set it
                 in the environment, as tests/conftest.py does, before Triton is imported); the
                 GPU's code path in bf16

Owners are the fusion targets of the op census (an owner's norms, rope, casts and FP8 codec
stay in it): `owner_of` reads the Python stack at each launch. Host work (the host schedule,
the commit's slot arithmetic and token history) is not a launch. On the CPU the step's two
host-to-device copies (the plan's packed buffer, the commit's moves) are no-ops and do not
count; on meta and a GPU they do. Table first, then one JSON
object as the last line."""
from __future__ import annotations

import argparse
import collections
import json
import linecache
import os
import sys
from pathlib import Path

import torch

import dsv4_tree as dt
from dsv4_tree.diagnostics import Launch, LaunchCounter

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_verify import FLASH_ATTENTION, TINY_ATTENTION  # noqa: E402

_PKG = os.path.dirname(dt.__file__) + os.sep
_KERNELS = str(Path(dt.__file__).resolve().parent.parent / "kernels") + os.sep
_COPIES = ("aten._to_copy", "aten.to", "aten.copy_")
OWNERS = ("table build", "mHC", "FP8 KV / entry writers", "attention (keys + core)", "indexer + top-k",
          "q / out projections", "MoE", "layer norms", "rope tables", "embed + head", "commit", "other")


def _chain():
    """(function, file, line text) of the project's frames on the stack, innermost first."""
    out, f = [], sys._getframe(2)
    while f is not None:
        fn = f.f_code.co_filename
        if fn.startswith(_PKG) or fn.startswith(_KERNELS):
            out.append((f.f_code.co_name, fn, f.f_lineno))
        f = f.f_back
    return out


def _line(chain, func: str) -> str:
    fr = next(c for c in chain if c[0] == func)
    return linecache.getline(fr[1], fr[2])


def owner_of(launch: Launch) -> str | None:
    """The owner of a launch (OWNERS), or None for host work."""
    chain = _chain()
    names = {c[0] for c in chain}
    if "build_step" in names or "build_from" in names:
        return "table build"
    if "commit" in names and any(c[0] == "commit" and c[1].endswith("engine.py") for c in chain):
        if "apply_moves" in names:
            return "commit"  # the pool copies
        if "to" in names and any(c[1].endswith("commit.py") for c in chain):  # SlotMoves.to: packs on the
            return "commit" if launch.name in _COPIES else None  # host, then the one host-to-device copy
        if "plan_moves" in names or "append" in names:
            return None  # slot arithmetic on host ints, the token history
        text = _line(chain, "commit")
        return "commit" if ("run." in text or "accumulated_ties" in text) else None
    if "run_plan" not in names:
        return None  # the host schedule (Engine.plan outside the build), checks
    if "row_rope" in names or "full" in names:
        return "rope tables"
    if "hc_head" in names:
        return "embed + head"
    if names & {"hc_weights", "hc_merge", "hc_collapse", "hc_pre", "hc_post"}:
        return "mHC"
    if "moe_rows" in names:
        return "MoE"
    if "decoder_layer_rows" not in names:
        return "embed + head" if "run_rows" in names else "other"
    if "attention_rows" not in names:
        return "layer norms"
    if "sparse_decode" in names:
        return "attention (keys + core)"
    if "indexer_select" in names:
        return "indexer + top-k"
    if "_compressed" in names:
        text = _line(chain, "_compressed")
        return "indexer + top-k" if ("iq" in text or "iw" in text) else "FP8 KV / entry writers"
    text = _line(chain, "attention_rows")
    return "FP8 KV / entry writers" if "swa_write" in text else "q / out projections"


def build_engine(backend: str, device: str, shapes: str, max_ctx: int, max_bs: int, kv: str = "fp8_e4m3"):
    kinds = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
    attention = FLASH_ATTENTION if shapes == "flash" else TINY_ATTENTION
    cfg = dt.tiny_config(**attention, num_hidden_layers=3, layer_types=kinds, mlp_layer_types=["moe"] * 3)
    if device == "meta":
        from dsv4_tree.hf_bindings import DeepseekV4ForCausalLM

        with torch.device("meta"):
            hf = DeepseekV4ForCausalLM(cfg).eval().to(torch.bfloat16)
    else:
        from dsv4_tree.checkpoint.tiny import random_model

        hf = random_model(cfg, seed=0).to(torch.bfloat16)
    spec = dt.SpecConfig(eagle_topk=4, num_steps=8, num_draft_tokens=8, prefill_chunk=64, max_requests=max_bs,
                         max_total_tokens=max_bs * (max_ctx + 256), kv_cache_dtype=kv, attention_backend=backend)
    return dt.Engine(dt.load_model(hf), spec)


def light_request(engine, seq_len: int, root_token: int = 5):
    """A committed request of seq_len positions whose rows are never written (zeros / meta)."""
    rt = engine.runtime
    row = rt.admit()
    rt.pages.ensure([row], [seq_len], [seq_len - rt.layout.recent_window])
    return engine.adopt(torch.zeros(seq_len, dtype=torch.int64), root_token, row, seq_len)


def _deepest(tree, req, out):
    from dsv4_tree.verify.accept import Acceptance

    path = tree.path[int(torch.argmax(tree.depth))]
    return Acceptance(tuple(int(x) for x in path[path >= 0].tolist()), 7, req.request_id, out.verify_id)


def count_step(engine, ctx: int, bs: int, nodes: int = 8) -> collections.Counter:
    """Launches of one step (plan's device build + forward + commit) by owner; host work left out."""
    from dsv4_tree.tree.simulate import eagle_tree

    reqs = [light_request(engine, ctx + (13 * b) % 64) for b in range(bs)]
    trees = [eagle_tree(5, nodes, topk=4, seed=b, vocab=engine.model.vocab_size) for b in range(bs)]
    try:
        engine.run_plan(engine.plan(reqs, trees), reqs)  # warm-up: maps the draft pages
        with LaunchCounter(device=engine.model.device, owner=owner_of) as launches:
            out = engine.run_plan(engine.plan(reqs, trees), reqs)
            engine.commit(reqs, [_deepest(t, r, out) for r, t in zip(reqs, trees)], out)
    finally:
        for r in reqs:
            engine.release(r)
    return launches.by_owner


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "meta", "cuda"))
    ap.add_argument("--backends", default=None, help="comma list (default: torch,triton; torch on meta)")
    ap.add_argument("--shapes", default=None, choices=("flash", "tiny"), help="default: flash on meta, else tiny")
    ap.add_argument("--contexts", default="4096,65536,1048576")
    ap.add_argument("--bs", default="1,8,64")
    args = ap.parse_args(argv)
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1" and "triton" in (args.backends or "triton"):
        ap.error("--device cpu runs the Triton kernels in the interpreter: set TRITON_INTERPRET=1 in the environment")
    backends = (args.backends or ("torch" if args.device == "meta" else "torch,triton")).split(",")
    shapes = args.shapes or ("flash" if args.device == "meta" else "tiny")
    contexts = [int(x) for x in args.contexts.split(",")]
    sizes = [int(x) for x in args.bs.split(",")]
    torch.set_num_threads(1)
    rows = []
    for backend in backends:
        engine = build_engine(backend, args.device, shapes, max(contexts), max(sizes))
        for ctx in contexts:
            for bs in sizes:
                by = count_step(engine, ctx, bs)
                rows.append(dict(backend=backend, context=ctx, bs=bs, total=sum(by.values()),
                                 by_owner={o: by[o] for o in OWNERS if by[o]}))
                print(f"{backend} ctx {ctx} bs {bs}: {rows[-1]['total']} launches", file=sys.stderr, flush=True)
        del engine
    cols = [f"{r['backend']} {r['context'] // 1024}K bs {r['bs']}" for r in rows]
    print(f"launches per verify step ({args.device}, {shapes} shapes, bf16, FP8 pools, N = 8)\n")
    print("| owner | " + " | ".join(cols) + " |")
    print("|---|" + "---|" * len(cols))
    for o in OWNERS:
        if any(o in r["by_owner"] for r in rows):
            print(f"| {o} | " + " | ".join(str(r["by_owner"].get(o, 0)) for r in rows) + " |")
    print("| **step** | " + " | ".join(f"**{r['total']}**" for r in rows) + " |")
    print(json.dumps(dict(device=args.device, shapes=shapes, rows=rows)))


if __name__ == "__main__":
    main()
