"""A verify step's device half: one host-to-device copy per step, no host synchronisation in the
device build or the forward, and the same number of ops whatever the context or the batch."""
import torch

import dsv4_tree as dt
from cases import prompt, random_tree, small_config
from dsv4_tree.diagnostics import HostToDeviceCounter, OpCounter, forbid_host_sync
from dsv4_tree.checkpoint.tiny import random_model
from dsv4_tree.serving.synth import synthetic_request
from dsv4_tree.tree.simulate import eagle_tree


def meta_engine(max_positions: int = 512, **spec):
    cfg = small_config()
    cfg.max_position_embeddings = max_positions
    hf = random_model(cfg).to("meta")
    hf.set_experts_implementation("batched_mm")  # transformers' eager experts loop reads nonzero() on the host
    kw = dict(eagle_topk=4, num_steps=8, num_draft_tokens=8, prefill_chunk=16)
    kw.update(spec)
    return dt.Engine(hf, dt.SpecConfig(**kw))


class DeviceHalf:
    """Wraps the runtime's device build so a test can run it inside a dispatch mode."""

    def __init__(self, engine, mode_factory):
        self.rt, self.orig, self.factory = engine.runtime, engine.runtime.build, mode_factory
        self.modes = []

    def __enter__(self):
        def build(step):
            mode = self.factory()
            self.modes.append(mode)
            with mode:
                return self.orig(step)

        self.rt.build = build
        return self

    def __exit__(self, *exc):
        self.rt.build = self.orig


def test_one_host_to_device_copy_per_step_and_none_in_the_forward():
    for bucketed in (0, 4):
        eng = meta_engine(cuda_graph_max_bs=bucketed)
        reqs = [eng.prefill(prompt(n, n)) for n in (21, 40, 9)]
        for rnd in range(2):
            trees = [random_tree(r.root_token, 8, 5, 3, 10 * rnd + b) for b, r in enumerate(reqs)]
            with HostToDeviceCounter() as h2d:
                plan = eng.plan(reqs, trees)
            assert h2d.copies == 1, f"{bucketed=} {rnd=}: {h2d.copies} host-to-device copies in plan"
            with HostToDeviceCounter() as h2d:
                eng.run_plan(plan, reqs)
            assert h2d.copies == 0, f"{bucketed=}: the forward copied {h2d.copies} host tensors"
            assert plan.positions.device.type == "meta" and plan.compress[4].entry_pages.device.type == "meta"


def test_device_build_and_forward_never_synchronise_the_host():
    """On CPU (where values exist) as on meta: forbid_host_sync applies to every device."""
    for eng in (meta_engine(), dt.Engine(dt.load_model(random_model(small_config())),
                                         dt.SpecConfig(eagle_topk=4, num_steps=8, num_draft_tokens=8))):
        reqs = [eng.prefill(prompt(n, n)) for n in (30, 17)]
        trees = [random_tree(r.root_token, 8, 5, 3, b) for b, r in enumerate(reqs)]
        with DeviceHalf(eng, forbid_host_sync):
            plan = eng.plan(reqs, trees)
        with forbid_host_sync():
            eng.run_plan(plan, reqs)


def step_ops(eng, reqs, trees) -> int:
    """aten ops of the device build plus the forward of one step (host schedule excluded)."""
    with DeviceHalf(eng, OpCounter) as half:
        plan = eng.plan(reqs, trees)
    with OpCounter() as fwd:
        eng.run_plan(plan, reqs)
    return half.modes[0].total + fwd.total


def test_ops_of_build_and_forward_do_not_grow_with_context_or_batch():
    eng = meta_engine(1 << 18, max_requests=8, max_total_tokens=(1 << 18) + 8192)
    counts = {}
    for ctx, bs in ((300, 1), (100_000, 1), (300, 8)):
        reqs = [synthetic_request(eng, ctx + 3 * b, seed=b) for b in range(bs)]
        trees = [eagle_tree(r.root_token, 8, topk=4, seed=b, vocab=500) for b, r in enumerate(reqs)]
        step_ops(eng, reqs, trees)  # the first step carries the synthetic requests' page mappings
        counts[ctx, bs] = step_ops(eng, reqs, trees)
        for r in reqs:
            eng.release(r)
    base = counts[300, 1]
    assert counts[100_000, 1] / base <= 1.02, f"ops grow with the context: {counts}"
    assert counts[300, 8] / base <= 1.02, f"ops grow with the batch: {counts}"


class DeviceOps(OpCounter):
    """Counts only ops on device (meta) tensors that are not views: the host page bookkeeping and
    metadata-only views are not what a GPU launches."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_leaves

        if not func.is_view and any(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in tree_leaves((args, kwargs or {}))):
            return super().__torch_dispatch__(func, types, args, kwargs)
        return func(*args, **(kwargs or {}))


def test_commit_moves_take_one_copy_and_the_same_ops_whatever_the_batch():
    eng = meta_engine()
    counts = {}
    for bs in (1, 4):
        reqs = [eng.prefill(prompt(13 + 4 * b, b)) for b in range(bs)]  # the same P mod 4 and mod 16
        rows, lens = [r.row for r in reqs], [r.seq_len for r in reqs]
        paths = [torch.tensor([0, 2, 5, 6]) for _ in reqs]  # moves, and a C4 block closed on the path
        eng.runtime.plan(rows, lens, [dt.DraftTree(torch.arange(8), torch.tensor([-1, 0, 0, 1, 2, 2, 5, 6]))] * bs)
        with HostToDeviceCounter() as h2d, DeviceOps() as ops:
            eng.runtime.commit(rows, lens, paths)
        assert h2d.copies == 1, f"{bs=}: {h2d.copies} host-to-device copies in commit"
        counts[bs] = ops.total
        for r in reqs:
            eng.release(r)
    assert counts[4] == counts[1], counts
