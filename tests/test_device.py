"""The device path: models stay where the caller put them, and prefill, verify, accept and
commit keep every tensor on the model's device without reading device data on the host,
except at the synchronisation points listed in design_notes/device-path.md.

The meta proxy runs on any CPU: the model and every cache tensor live on the `meta` device
(shapes only). An op mixing a meta tensor with a CPU one raises, and so does every host read
of device data (.item(), int(t), bool(t), .tolist(), .cpu()). Next to it, the same flow on a
real CUDA device, checked against the per-path oracle (marked gpu)."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import dsv4_tree as dt
from cases import REL_TOL, check_against_oracle, prompt, random_tree, small_config, small_model, snapshot
from dsv4_tree.drafters import MtpDrafter, TreeShape
from dsv4_tree.checkpoint.tiny import random_model
from dsv4_tree.reference import per_path_logits, relative_error
from dsv4_tree.verify.accept import Acceptance

SPEC = dt.SpecConfig(eagle_topk=4, num_steps=8, num_draft_tokens=16, prefill_chunk=16)
COPIES = {torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default}


class NoHostTensorsInDeviceOps(TorchDispatchMode):
    """Fails any op that mixes a meta tensor with a (non-scalar) CPU tensor other than an
    explicit copy. PyTorch itself lets a CPU index tensor index a device tensor (on CUDA it is
    a hidden blocking copy); this catches that too."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tensors = [t for t in tree_leaves((args, kwargs or {})) if isinstance(t, torch.Tensor)]
        if func not in COPIES and any(t.device.type == "meta" for t in tensors):
            host = [tuple(t.shape) for t in tensors if t.device.type == "cpu" and t.dim() > 0]
            assert not host, f"{func}: host tensors of shapes {host} mixed with meta tensors"
        return func(*args, **(kwargs or {}))


def meta_model():
    hf = random_model(small_config()).to("meta")
    # transformers' default eager experts loop reads `nonzero()` on the host in every MoE
    # layer (its code, not ours); batched_mm routes without a host read
    hf.set_experts_implementation("batched_mm")
    return hf


def pool_tensors(engine):
    """(name, tensor) of every pool of every layer: all committed state lives there."""
    for li, lp in enumerate(engine.runtime.pools):
        yield f"layer {li} swa", lp.swa.storage
        for name in ("main", "indexer"):
            comp = getattr(lp, name)
            if comp is not None:
                yield f"layer {li} {name} rows_kv", comp.rows_kv
                yield f"layer {li} {name} rows_gate", comp.rows_gate
                yield f"layer {li} {name} entries", comp.entries.storage


def all_on(device: str, engine, reqs, out=None) -> None:
    for name, t in pool_tensors(engine):
        assert t.device.type == device, f"{name} on {t.device}"
    for req in reqs:
        assert req.new_hidden.device.type == device and req.ties.device.type == device
    if out is not None:
        assert all(lg.device.type == device for lg in out.logits)
        assert out.run.hidden.device.type == device and out.run.topk_ties.device.type == device


def host_acceptance(req, tree, out, node: int, bonus: int) -> Acceptance:
    """What accept_greedy returns, chosen on the host: the root-to-`node` path and a bonus."""
    path = tree.path[node][tree.path[node] >= 0]
    return Acceptance(tuple(path.tolist()), bonus, req.request_id, out.verify_id)


def test_wrapping_keeps_the_callers_device_and_dtype():
    hf = random_model(small_config()).to(torch.bfloat16)
    engine = dt.Engine(hf, SPEC)
    assert engine.model.hf is hf and engine.model.dtype == torch.bfloat16 and engine.model.device.type == "cpu"
    assert all(p.dtype == torch.bfloat16 for p in hf.parameters())
    meta = dt.load_model(meta_model())  # a .to("cpu") here would raise: meta tensors hold no data
    assert meta.device.type == "meta" and meta.dtype == torch.float32
    asked = dt.load_model(hf, dtype=torch.float32)  # explicit wishes are honoured
    assert asked.dtype == torch.float32
    with pytest.raises(dt.InputError, match="dtype"):
        dt.load_model(hf, dtype="bf16")


def test_plan_moves_every_index_tensor_to_the_device():
    engine = dt.Engine(small_model(), SPEC)
    reqs = [engine.prefill(prompt(22, 1)), engine.prefill(prompt(9, 2))]
    trees = [random_tree(r.root_token, 12, 6, 3, b) for b, r in enumerate(reqs)]
    host = engine.plan(reqs, trees)
    plan = host.to("meta")
    tensors = [plan.input_ids, plan.positions, plan.out_loc, plan.swa_index, plan.swa_len, plan.groups.row_req,
               plan.groups.row_slot, plan.groups.req_rows]
    for ct in plan.compress.values():
        tensors += [ct.closes, ct.entry_out, ct.block_start, ct.src, ct.entry_pages, ct.entry_len, ct.branch,
                    ct.branch_len]
    assert len(plan.compress) == 2 and all(t.device.type == "meta" for t in tensors)
    assert plan.trees[0] is trees[0] and plan.trees[0].tokens.device.type == "cpu"  # host bookkeeping stays
    assert host.swa_index.device.type == "cpu"  # the host plan is untouched (commit reads it)


def test_guard_catches_a_host_index_into_a_device_tensor():
    table = torch.zeros(4, 2, device="meta")
    with NoHostTensorsInDeviceOps(), pytest.raises(AssertionError, match="host tensors"):
        table[torch.tensor([0, 2])]


def test_meta_proxy_prefill_verify_accept_commit_stay_on_device():
    engine = dt.Engine(meta_model(), SPEC)
    with NoHostTensorsInDeviceOps():
        meta_flow(engine)


def meta_flow(engine):
    reqs = [engine.prefill(prompt(n, seed)) for n, seed in ((19, 1), (30, 2))]  # 2 chunks each
    all_on("meta", engine, reqs)
    for rnd in range(2):
        trees = [random_tree(r.root_token, 16, 7, 3, 10 * rnd + b) for b, r in enumerate(reqs)]
        out = engine.verify(reqs, trees)
        all_on("meta", engine, reqs, out)
        assert [tuple(lg.shape) for lg in out.logits] == [(16, 512), (16, 512)]
        # accept_greedy is a synchronisation point: it reads the logits' argmax on the host
        with pytest.raises(NotImplementedError, match="meta"):
            engine.accept_greedy(reqs, trees, out)
        deepest = [int(t.depth.argmax()) for t in trees]
        accs = [host_acceptance(r, t, out, node, 7 + b) for b, (r, t, node) in enumerate(zip(reqs, trees, deepest))]
        before = [r.seq_len for r in reqs]
        engine.commit(reqs, accs, out)
        assert [r.seq_len for r in reqs] == [p + len(a.path) for p, a in zip(before, accs)]
        assert [r.root_token for r in reqs] == [7, 8]
        all_on("meta", engine, reqs)


def test_meta_proxy_mtp_draft_forward_stays_on_device():
    """The MTP drafter's draft-extend and a forward over draft rows (its top-k choice is host work)."""
    from dsv4_tree.drafters.mtp_cache import window_index
    from dsv4_tree.drafters.mtp_rows import draft_rows

    model = dt.load_model(dt.tiny_checkpoint())
    model.hf.set_experts_implementation("batched_mm")  # before the drafter copies the config
    drafter = MtpDrafter(model, TreeShape(2, 3, 6))
    model.hf.to("meta")
    drafter.mtp.to("meta")
    engine = dt.Engine(model, dt.SpecConfig(eagle_topk=2, num_steps=3, num_draft_tokens=6))
    with NoHostTensorsInDeviceOps():
        req = engine.prefill(prompt(40, 3))
        cache = drafter.sync([req])[0]
        dev = model.device
        lengths = torch.tensor([cache.window.shape[0]])  # host bookkeeping
        index = torch.cat([window_index(lengths, 0, 1, model.window, dev),
                           torch.tensor([[cache.window.shape[0]]], device=dev)], 1)
        rows = draft_rows(model, drafter.mtp, torch.tensor([req.root_token], device=dev), cache.prev_hidden.unsqueeze(0),
                        torch.tensor([req.seq_len], device=dev), cache.window, index)
    assert rows.logits.device.type == rows.hidden.device.type == cache.window.device.type == "meta"
    assert tuple(rows.logits.shape) == (1, model.vocab_size)


@pytest.mark.gpu
def test_cuda_prefill_verify_accept_commit_match_the_oracle(device):
    model = small_model(device=device.type)
    engine = dt.Engine(model, SPEC)
    prompts = [prompt(19, 1), prompt(30, 2)]
    check_against_oracle(model, engine, prompts, [random_tree(int(p[-1]), 16, 7, 3, b) for b, p in enumerate(prompts)])
    reqs = [engine.prefill(p) for p in prompts]
    cpu_engine = dt.Engine(small_model(), SPEC)
    cpu_reqs = [cpu_engine.prefill(p) for p in prompts]
    for rnd in range(2):
        trees = [random_tree(r.root_token, 16, 7, 3, 10 * rnd + b) for b, r in enumerate(reqs)]
        out = engine.verify(reqs, trees)
        all_on(device.type, engine, reqs, out)
        for b, (r, t) in enumerate(zip(reqs, trees)):
            err = relative_error(out.logits[b], per_path_logits(model, r.tokens, t))
            assert err < REL_TOL, f"round {rnd} request {b}: {err:.2e}"
        accs = engine.accept_greedy(reqs, trees, out)
        cpu_out = cpu_engine.verify(cpu_reqs, trees)
        assert [a.path for a in accs] == [a.path for a in cpu_engine.accept_greedy(cpu_reqs, trees, cpu_out)]
        engine.commit(reqs, accs, out)
        cpu_engine.commit(cpu_reqs, [Acceptance(a.path, a.bonus, c.request_id, cpu_out.verify_id)
                                     for a, c in zip(accs, cpu_reqs)], cpu_out)
        all_on(device.type, engine, reqs)
        for r, c in zip(reqs, cpu_reqs):
            for got, want in zip(snapshot(engine, r), snapshot(cpu_engine, c)):
                for name in want:
                    assert torch.allclose(got[name].cpu().float(), want[name].float(), atol=1e-5), name


def test_rows_experts_avoids_the_host_synchronising_grouped_gemm():
    from types import SimpleNamespace

    from dsv4_tree.numerics.moe import rows_experts

    def experts(device, dtype):
        return SimpleNamespace(gate_up_proj=SimpleNamespace(device=torch.device(device), dtype=dtype))

    # torch's CUDA grouped GEMM reads its offsets on the host for fp32 (the H200 run); kept FP8
    # / FP4 experts have transformers' own grouped kernels; fp16 stays grouped (batched_mm's
    # scratch grows with rows x top-k x expert size)
    assert rows_experts(experts("cuda", torch.float32)) == "batched_mm"
    for dtype in (torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.int8):
        assert rows_experts(experts("cuda", dtype)) == "grouped_mm", dtype
    assert rows_experts(experts("cpu", torch.float32)) == "grouped_mm"
    assert rows_experts(small_model().hf.model.layers[0].mlp.experts) == "grouped_mm"


def test_meta_bf16_grouped_moe_stays_on_the_device():
    """moe_rows' grouped path off the CPU (what a bf16 model on cuda runs: ints into histc,
    transformers' grouped GEMM dispatcher) reached on the meta device, whose grouped GEMM takes bf16."""
    from dsv4_tree.numerics.moe import grouped_applies, moe_rows

    hf = random_model(small_config()).to(torch.bfloat16).to("meta")
    mlp = hf.model.layers[2].mlp
    assert grouped_applies(mlp.experts)
    x = torch.randn(1, 5, hf.config.hidden_size, dtype=torch.bfloat16, device="meta")
    with torch.inference_mode(), NoHostTensorsInDeviceOps():
        out = moe_rows(mlp, x, None)
    assert out.device.type == "meta" and out.dtype == torch.bfloat16 and tuple(out.shape) == tuple(x.shape)


def test_batched_and_grouped_experts_give_the_same_verify():
    model = dt.load_model(small_model().hf)
    eng = dt.Engine(model, SPEC)
    p = prompt(40, 3)
    tree = random_tree(int(p[-1]), 16, 8, 4, seed=5)
    grouped = eng.verify([eng.prefill(p)], [tree]).logits[0]
    before = model.hf.config._experts_implementation
    model.hf.set_experts_implementation("batched_mm")  # a caller's choice is kept by moe_rows
    try:
        eng2 = dt.Engine(model, SPEC)
        batched = eng2.verify([eng2.prefill(p)], [tree]).logits[0]
    finally:
        model.hf.set_experts_implementation(before)
    assert relative_error(batched, grouped) < REL_TOL


def test_transformers_default_experts_are_replaced_a_callers_choice_is_kept():
    from types import SimpleNamespace

    from dsv4_tree.numerics.moe import experts_implementation

    # transformers 5.23 defaults to grouped_mm (eager where torch lacks it): both are replaced,
    # so a default fp32 model on cuda gets batched_mm (the first H200 run caught grouped_mm there)
    for default in (None, "eager", "grouped_mm"):
        cfg = SimpleNamespace(_experts_implementation=default)
        with experts_implementation(cfg, "batched_mm"):
            assert cfg._experts_implementation == "batched_mm"
        assert cfg._experts_implementation == default
    cfg = SimpleNamespace(_experts_implementation="batched_mm")
    with experts_implementation(cfg, "grouped_mm"):
        assert cfg._experts_implementation == "batched_mm"
    assert small_model().hf.config._experts_implementation == "grouped_mm"  # the default this guards


def test_verify_outputs_are_inference_tensors_and_drafted_trees_are_not():
    # the forward runs under torch.inference_mode (design_notes/fewer-ops.md): its outputs can
    # be read, and cloned to edit; the drafter's trees are ordinary tensors
    model = dt.load_model(dt.trained_checkpoint())
    eng = dt.Engine(model, SPEC)
    req = eng.prefill(torch.arange(40) % 200 + 32)
    drafter = MtpDrafter(model, TreeShape(4, 3, 8), record=True)
    tree = drafter.draft(eng, [req])[0]
    assert not tree.tokens.is_inference() and not tree.parents.is_inference()
    record = drafter.records[req.request_id]
    assert not record.tree.tokens.is_inference() and not record.rows.logits.is_inference()
    out = eng.verify([req], [tree])
    assert out.logits[0].is_inference()
    with pytest.raises(RuntimeError, match="[Ii]nference tensor"):
        out.logits[0][0, 0] = 0.0
    edited = out.logits[0].clone()
    edited[0, 0] = 0.0  # a clone is an ordinary tensor
    accs = eng.accept_greedy([req], [tree], out)
    eng.commit([req], accs, out)
    assert not req.new_hidden.is_inference()
