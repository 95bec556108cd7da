"""bf16: tree verify of a bf16 model is as close to fp32 per-path runs as Hugging Face's own
bf16 forward is (design_notes/tolerances.md).

Statistic: for each verify row (node) i, e_i = max_v |logits_i[v] - fp32_i[v]| / max_v |fp32_i[v]|
(fp32_i: the fp32 model's per-path run of node i); the test compares the worst row over all
rows of the call. Ours: the bf16 engine's verify logits. Hugging Face's: the bf16 model's own
per-path runs of the same rows. Ours must not exceed 2x Hugging Face's."""
import dataclasses

import pytest
import torch

import dsv4_tree as dt
from cases import prompt, random_tree
from dsv4_tree.reference import per_path_logits


def row_errors(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """e_i per row (see the module docstring). [N]"""
    a, e = actual.double().cpu(), expected.double().cpu()
    return (a - e).abs().amax(-1) / e.abs().amax(-1)


def test_bf16_tree_verify_error_within_twice_hugging_faces_own():
    fp32 = dt.load_model(dt.tiny_checkpoint())
    bf16 = dt.load_model(dt.tiny_checkpoint(), dtype=torch.bfloat16)
    eng = dt.Engine(bf16, dt.SpecConfig(eagle_topk=4, num_steps=8, num_draft_tokens=16))
    # P = 35 and 61: trees close C4 blocks; different P mod 4 in one call
    prompts = [prompt(36, 4), prompt(62, 5)]
    trees = [random_tree(int(p[-1]), 16, 5, 3, seed) for seed, p in enumerate(prompts)]
    reqs = [eng.prefill(p) for p in prompts]
    out = eng.verify(reqs, trees)
    assert all(lg.dtype == torch.bfloat16 for lg in out.logits)
    ours, theirs = [], []
    for p, tree, logits in zip(prompts, trees, out.logits):
        want = per_path_logits(fp32, p[:-1], tree, batch_by_depth=True)
        ours.append(row_errors(logits, want))
        theirs.append(row_errors(per_path_logits(bf16, p[:-1], tree, batch_by_depth=True), want))
    ours, theirs = torch.cat(ours), torch.cat(theirs)
    assert torch.isfinite(ours).all()
    assert ours.max() <= 2 * theirs.max(), (
        f"worst row: ours {ours.max():.3e}, Hugging Face bf16 {theirs.max():.3e}; "
        f"means {ours.mean():.3e} vs {theirs.mean():.3e}")


def recorded_picks(engine) -> list:
    """Wrap engine's indexer top-k: the list it returns fills, per call (C4 layer, in order), with
    each row's picks as entry indices in block order (committed j, then its branch entries)."""
    calls, inner = [], engine.ops.indexer_topk

    def topk(q, weights, keys, entry_pages, epp, entry_len, branch, req_rows, scale, k):
        out = inner(q, weights, keys, entry_pages, epp, entry_len, branch, req_rows, scale, k)
        pages, n_e = entry_pages.cpu().long(), int(entry_len[0])  # one request
        block = {int(pages[0, j // epp]) * epp + j % epp: j for j in range(n_e)}
        picks = []
        for t, sel in enumerate(out[0].cpu().tolist()):
            own = {int(x): n_e + i for i, x in enumerate(branch[t].cpu().tolist()) if x >= 0}
            picks.append(frozenset({**block, **own}[x] for x in sel if x >= 0))
        calls.append(picks)
        return out

    engine.ops = dataclasses.replace(engine.ops, indexer_topk=topk)
    return calls


@torch.no_grad()
def forced_path_logits(model, committed, tree, node: int, forced: dict) -> torch.Tensor:
    """The fp32 oracle's logits of `node`'s path with some top-k picks imposed: forced maps
    (C4 layer call, node r) -> entry indices; where r is on the path, the query at r's position
    selects exactly those (their scores raised by 1e4; HF's scores feed only its top-k)."""
    scorers = [m for name, m in model.hf.named_modules() if name.endswith("indexer.scorer")]
    path = set(tree.path[node][tree.path[node] >= 0].tolist())
    handles = []
    for li, m in enumerate(scorers):
        at = [(len(committed) + int(tree.depth[r]), sorted(sel)) for (c, r), sel in forced.items() if c == li and r in path]

        def hook(module, args, scores, at=at):
            if not at:
                return None
            scores = scores.clone()
            for q, sel in at:
                scores[0, q, sel] += 1e4
            return scores

        handles.append(m.register_forward_hook(hook))
    try:
        ids = torch.cat([committed, tree.path_tokens(node)]).unsqueeze(0)
        return model.hf(input_ids=ids, use_cache=False).logits[0, -1]
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def path_scores(model, committed, tree, node: int) -> list:
    """Hugging Face's indexer scores of `node`'s own query (the last position of its path), per
    C4 layer, in block order: [entries] float64 each (entries past the causal limit: -inf)."""
    scorers = [m for name, m in model.hf.named_modules() if name.endswith("indexer.scorer")]
    seen = []
    handles = [m.register_forward_hook(lambda mod, args, out: seen.append(out[0, -1].double().cpu())) for m in scorers]
    try:
        model.hf(input_ids=torch.cat([committed, tree.path_tokens(node)]).unsqueeze(0).to(model.hf.device),
                 use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return seen


def assert_near_tie(fp32, bf16, committed, tree, node: int, layer: int, ours, ref) -> None:
    """Our pick at (layer, node) differs from the fp32 engine's: it must be a choice bf16 may
    make. The fp32 preference of an entry left out over one taken in, max(s[out]) - min(s[in]),
    must not exceed twice Hugging Face's own bf16 score error on that query (each of the two
    scores may move by that much, in opposite directions), max_j |s_bf16[j] - s_fp32[j]|."""
    s32 = path_scores(fp32, committed, tree, node)[layer]
    s16 = path_scores(bf16, committed.to(bf16.hf.device), tree, node)[layer]
    live = torch.isfinite(s32)
    dev = float((s16[live] - s32[live]).abs().max())
    taken, left = sorted(ours - ref), sorted(ref - ours)
    gap = float(s32[left].max() - s32[taken].min())
    assert gap <= 2 * dev, f"C4 layer {layer} node {node}: picks {sorted(ours)} vs fp32 {sorted(ref)}, fp32 gap {gap:.3e} > 2 x {dev:.3e}"


# slow (nightly, docs/testing.md): a bf16 model through the interpreted kernels; on a GPU scripts/gpu_check runs it
# (-m 'gpu or on_device'); the bf16 torch backend against HF's own error stays in every run
@pytest.mark.slow
def test_bf16_model_on_the_triton_backend_matches_the_torch_backend(device):
    # a model cast with .to(bfloat16) has bf16 attention sinks (from_pretrained keeps them fp32):
    # the kernels take them (the H200 run of bench_verify --backend triton refused bf16 sinks).
    # On the `device` fixture: cuda under scripts/gpu_check, the Triton interpreter here.
    fp32 = dt.load_model(dt.tiny_checkpoint())
    bf16 = dt.load_model(dt.load_model(dt.tiny_checkpoint()).hf, device=device.type, dtype=torch.bfloat16)
    assert bf16.hf.model.layers[0].self_attn.sinks.dtype == torch.bfloat16
    p = prompt(36, 4)
    tree = random_tree(int(p[-1]), 8, 4, 3, 1)
    want = per_path_logits(fp32, p[:-1], tree, batch_by_depth=True)
    hf = row_errors(per_path_logits(bf16, p[:-1].to(device), tree, batch_by_depth=True), want)
    fp32_eng = dt.Engine(fp32, dt.SpecConfig(eagle_topk=4, num_steps=8, num_draft_tokens=16))
    fp32_req = fp32_eng.prefill(p)
    fp32_picks = recorded_picks(fp32_eng)  # the verify's calls only
    fp32_eng.verify([fp32_req], [tree])
    for backend in ("torch", "triton"):
        eng = dt.Engine(bf16, dt.SpecConfig(eagle_topk=4, num_steps=8, num_draft_tokens=16, attention_backend=backend))
        req = eng.prefill(p.to(device))
        picks = recorded_picks(eng)
        logits = eng.verify([req], [tree]).logits[0]
        assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all(), backend
        # An indexer boundary that is a near tie at bf16 precision may pick either entry: a
        # legitimate bf16 result (design_notes/fewer-ops.md, hc_pre). Where our picks differ from
        # the fp32 engine's, the difference must be such a near tie (assert_near_tie), and the
        # rows on it (the row and its descendants) are compared with the fp32 oracle made to
        # pick as we did; every other row with the plain oracle.
        forced = {(c, r): sel for c, (ours, ref) in enumerate(zip(picks, fp32_picks))
                  for r, (sel, ref_sel) in enumerate(zip(ours, ref)) if sel != ref_sel}
        for c, r in forced:
            assert_near_tie(fp32, bf16, p[:-1], tree, r, c, forced[c, r], fp32_picks[c][r])
        expected = want.clone()
        for node in range(tree.num_nodes):
            if any(r in tree.path[node].tolist() for _, r in forced):
                expected[node] = forced_path_logits(fp32, p[:-1], tree, node, forced)
        err = row_errors(logits, expected)
        # Both backends round every bf16 activation, K=V row and entry (unit roundoff 2^-8) and
        # differ only in summation order and where the output casts fall, so neither may be
        # further from the fp32 per-path oracle than the first test allows: 2x the worst row of
        # Hugging Face's own bf16 forward of the same paths. That error is measured here, on
        # this CPU's kernels (AVX2 and AVX-512 bf16 matmuls round differently), so the bound
        # moves with the instruction set instead of being read off one machine.
        assert err.max() <= 2 * hf.max(), (
            f"{backend}: worst row {err.max():.3e} vs Hugging Face bf16 {hf.max():.3e}; rows {err.tolist()}; "
            f"picks unlike fp32's at (C4 layer, row) {sorted(forced)}")
