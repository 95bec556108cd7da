"""Shared case generators: small models, prompts, random trees, and the oracle comparison."""
from __future__ import annotations

import functools
import re

import torch
from safetensors.torch import load_file

import dsv4_tree as dt
from dsv4_tree.checkpoint.tiny import random_model
from dsv4_tree.reference import per_path_logits, relative_error

# fp32 end to end; our gathers/matmuls sum in a different order than HF's dense masked
# attention, so logits differ by rounding only (seen: ~1e-6 relative). 1e-4 leaves two orders
# of magnitude for that while any visibility bug (a wrong key or entry) shows up as >1e-2.
REL_TOL = 1e-4
VOCAB = 512


def small_config(window: int = 8, hca: int = 16, topk: int = 3, sliding_only: bool = False):
    """Tiny config with a short window and HCA ratio so crossings happen at short lengths."""
    kw = dict(sliding_window=window, compress_rates={"heavily_compressed_attention": hca}, index_topk=topk,
              max_position_embeddings=512)
    if sliding_only:
        kw.update(num_hidden_layers=2, layer_types=["sliding_attention"] * 2, mlp_layer_types=["hash_moe", "moe"])
    return dt.tiny_config(**kw)


@functools.lru_cache(maxsize=None)
def small_model(window: int = 8, hca: int = 16, topk: int = 3, sliding_only: bool = False, device: str = "cpu"):
    """The small_config model (seeded random weights, fp32) on `device`."""
    return dt.load_model(random_model(small_config(window, hca, topk, sliding_only)).to(device))


def snapshot(engine, req) -> list:
    """A request's committed state, per layer: dict name -> tensor (HF cache-field names)."""
    return engine.state_summary(req)


PAGE_SIZES = (256, 16)  # SGLang's, and a small one so page crossings happen at short lengths


def engine_for(model, topk: int = 4, steps: int = 12, nodes: int = 64, **spec) -> dt.Engine:
    return dt.Engine(model, dt.SpecConfig(eagle_topk=topk, num_steps=steps, num_draft_tokens=nodes, **spec))


def prompt(length: int, seed: int) -> torch.Tensor:
    return torch.randint(2, VOCAB, (length,), generator=torch.Generator().manual_seed(seed))


def random_tree(root: int, n: int, max_depth: int, max_children: int, seed: int, dup_siblings: bool = False):
    """Random tree with parents before children, depth <= max_depth, <= max_children per node.
    dup_siblings: give some siblings the same token."""
    g = torch.Generator().manual_seed(seed)
    parents, depth, kids = [-1], [0], [0]
    while len(parents) < n:
        cands = [j for j in range(len(parents)) if depth[j] < max_depth and kids[j] < max_children]
        if not cands:
            break
        p = cands[int(torch.randint(len(cands), (1,), generator=g))]
        parents.append(p)
        depth.append(depth[p] + 1)
        kids[p] += 1
        kids.append(0)
    toks = torch.randint(2, VOCAB, (len(parents),), generator=g)
    toks[0] = root
    if dup_siblings:
        for i in range(2, len(parents)):
            if parents[i] == parents[i - 1] and i % 2 == 0:
                toks[i] = toks[i - 1]
    return dt.DraftTree(toks, torch.tensor(parents, dtype=torch.int64))


def spine_tree(root: int, n: int, depth: int, max_children: int, seed: int):
    """A branching tree of exactly `depth`: a root-to-leaf spine of depth `depth`, then n - depth - 1
    random nodes hung anywhere above the last level (<= max_children per node)."""
    g = torch.Generator().manual_seed(seed)
    parents, level, kids = [-1] + list(range(depth)), list(range(depth + 1)), [1] * depth + [0]
    while len(parents) < n:
        cands = [j for j in range(len(parents)) if level[j] < depth and kids[j] < max_children]
        p = cands[int(torch.randint(len(cands), (1,), generator=g))]
        parents.append(p)
        level.append(level[p] + 1)
        kids[p] += 1
        kids.append(0)
    toks = torch.randint(2, VOCAB, (n,), generator=g)
    toks[0] = root
    return dt.DraftTree(toks, torch.tensor(parents, dtype=torch.int64))


def deep_chain_tree(root: int, depth: int, seed: int):
    return random_tree(root, depth + 1, depth, 1, seed)


def check_against_oracle(model, engine, prompts, trees, label: str = "") -> float:
    """Verify all requests in one call; every row must match its per-path HF run."""
    reqs = [engine.prefill(p) for p in prompts]
    out = engine.verify(reqs, trees)
    # the oracle recomputes the committed rows too: they must be tie-free as well as the tree's
    committed_ties = [r.committed_topk_ties for r in reqs]
    assert out.topk_ties == 0 and not any(committed_ties), (
        f"{label}: indexer tie at the top-k boundary (tree {out.topk_ties}, committed rows {committed_ties}); "
        "choose another seed")
    worst = 0.0
    for b, (p, tree) in enumerate(zip(prompts, trees)):
        ref = per_path_logits(model, p[:-1], tree, apply_tie_rule=False)  # untouched HF
        err = relative_error(out.logits[b], ref)
        assert err < REL_TOL, f"{label} request {b}: P={p.numel() - 1} N={tree.num_nodes} depth={tree.max_depth} rel_err={err:.3e}"
        worst = max(worst, err)
    return worst


def assert_weights_from_file(hf, path) -> None:
    """Every parameter and buffer of the loaded `hf` model equals (after the dtype cast) a tensor
    read straight from the checkpoint's safetensors, and every tensor of the file is used: a
    check independent of from_pretrained and its renaming. Routed experts are fused on load
    (w1|w3 -> gate_up_proj, w2 -> down_proj, stacked over experts); the file's mtp.* tensors
    belong to the MTP block, not to the causal LM."""
    file = {}
    for f in sorted(path.glob("*.safetensors")):
        file.update(load_file(str(f)))
    file = {k: v for k, v in file.items() if not k.startswith("mtp.")}
    used = set()
    for name, p in hf.state_dict().items():
        fused = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)", name)
        if fused:
            pre = f"model.layers.{fused.group(1)}.ffn.experts"
            keys = {w: [f"{pre}.{e}.{w}.weight" for e in range(p.shape[0])] for w in ("w1", "w2", "w3")}
            w = {k: torch.stack([file[n] for n in names]).to(p.dtype) for k, names in keys.items()}
            want = torch.cat([w["w1"], w["w3"]], 1) if fused.group(2) == "gate_up_proj" else w["w2"]
            ok = any(c.shape == p.shape and torch.equal(c, p) for c in (want, want.transpose(1, 2)))
            assert ok, f"{name} is not the file's stacked experts"
            used.update(n for names in keys.values() for n in names)
            continue
        hits = [k for k, v in file.items() if v.shape == p.shape and torch.equal(v.to(p.dtype), p)]
        assert hits, f"{name} equals no tensor of {path} (left at initialisation?)"
        used.update(hits)
    assert not set(file) - used, f"tensors of {path} the model does not use: {sorted(set(file) - used)[:5]}"
