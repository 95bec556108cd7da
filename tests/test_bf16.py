"""bf16: tree verify of a bf16 model is as close to fp32 per-path runs as Hugging Face's own
bf16 forward is (design_notes/tolerances.md).

Statistic: for each verify row (node) i, e_i = max_v |logits_i[v] - fp32_i[v]| / max_v |fp32_i[v]|
(fp32_i: the fp32 model's per-path run of node i); the test compares the worst row over all
rows of the call. Ours: the bf16 engine's verify logits. Hugging Face's: the bf16 model's own
per-path runs of the same rows. Ours must not exceed 2x Hugging Face's."""
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


def test_bf16_model_on_the_triton_backend_matches_the_torch_backend(device):
    # a model cast with .to(bfloat16) has bf16 attention sinks (from_pretrained keeps them fp32):
    # the kernels take them (the H200 run of bench_verify --backend triton refused bf16 sinks).
    # On the `device` fixture: cuda under scripts/gpu_check, the Triton interpreter here.
    bf16 = dt.load_model(dt.load_model(dt.tiny_checkpoint()).hf, device=device.type, dtype=torch.bfloat16)
    assert bf16.hf.model.layers[0].self_attn.sinks.dtype == torch.bfloat16
    p = prompt(36, 4).to(device)
    tree = random_tree(int(p[-1]), 8, 4, 3, 1)
    logits = {}
    for backend in ("torch", "triton"):
        eng = dt.Engine(bf16, dt.SpecConfig(eagle_topk=4, num_steps=8, num_draft_tokens=16, attention_backend=backend))
        logits[backend] = eng.verify([eng.prefill(p)], [tree]).logits[0].float()
    err = row_errors(logits["triton"], logits["torch"])
    # two bf16 paths (kernel vs torch ops) round differently at every layer; measured 3.2e-2 on
    # CPU (the interpreter truncates the kernel's bf16 output cast), under the 4.1e-2 this
    # file's other test measured for our bf16 verify against fp32, so 5e-2
    assert torch.isfinite(logits["triton"]).all() and err.max() < 5e-2, err
