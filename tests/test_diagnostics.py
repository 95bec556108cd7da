"""OpCounter counts dispatched aten ops; forbid_host_sync raises on ops that make the host wait."""
import pytest
import torch

import dsv4_tree as dt
from dsv4_tree.diagnostics import OpCounter, forbid_host_sync


def test_op_counter_counts_total_and_by_name():
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    with OpCounter() as ops:
        c = a @ b  # aten.mm
        c = c + 1  # aten.add
        c = c + 1
        c.relu()  # aten.relu
    assert ops.total == 4, dict(ops.by_name)
    assert ops.by_name == {"aten.mm": 1, "aten.add": 2, "aten.relu": 1}


def test_op_counter_sees_ops_in_a_loop_and_nothing_outside():
    x = torch.randn(8)
    with OpCounter() as ops:
        for i in range(5):
            x = x * 2
    x = x * 2  # after the block: not counted
    assert ops.total == 5 and ops.by_name["aten.mul"] == 5, dict(ops.by_name)


def test_op_counter_grows_with_a_python_loop_but_not_with_a_batched_op():
    """The property the batch tests rely on: a per-item loop costs ops per item, one batched
    op costs the same at any size."""

    def looped(xs):
        return [x.sum() for x in xs]

    def batched(xs):
        return xs.sum(dim=1)

    counts = {}
    for bs in (1, 8):
        xs = torch.randn(bs, 16)
        with OpCounter() as lo:
            looped(xs)
        with OpCounter() as ba:
            batched(xs)
        counts[bs] = (lo.total, ba.total)
    assert counts[8][0] > counts[1][0], counts  # iterating also dispatches one select per item
    assert counts[8][1] == counts[1][1] == 1, counts


@pytest.mark.parametrize(
    "what,fn",
    [
        ("_local_scalar_dense", lambda t: t[0].item()),
        ("_local_scalar_dense", lambda t: int(t[0])),
        ("_local_scalar_dense", lambda t: bool(t.any())),
        ("nonzero", lambda t: t.nonzero()),
        ("equal", lambda t: torch.equal(t, t)),
        ("masked_select", lambda t: t.masked_select(t > 0)),
        ("index", lambda t: t[t > 0]),  # boolean mask: data-dependent shape
        ("index_put", lambda t: t.__setitem__(t > 0, 0.0)),  # t[mask] = 0
        ("unique", lambda t: t.unique()),
        ("bincount", lambda t: torch.bincount(t.long().clamp(min=0), minlength=8)),  # sized by its largest value
        ("repeat_interleave", lambda t: torch.repeat_interleave(torch.tensor([1, 2]))),
    ],
)
def test_forbid_host_sync_raises_and_names_the_op(what, fn):
    t = torch.tensor([1.0, -2.0, 3.0])
    with pytest.raises(dt.StateError, match=what):
        with forbid_host_sync():
            fn(t)


@pytest.mark.parametrize("copy", [lambda x: x.cpu(), lambda x: x.to("cpu"), lambda x: torch.empty(3).copy_(x)])
def test_forbid_host_sync_raises_on_device_to_host_copy(copy):
    x = torch.empty(3, device="meta")  # any non-CPU device; meta stands in for CUDA on CPU
    with pytest.raises(dt.StateError, match="copies a meta tensor to the host"):
        with forbid_host_sync():
            copy(x)


def test_forbid_host_sync_allows_device_only_work():
    """Index arithmetic with shapes known on the host passes: gathers, integer indexing, topk,
    where, repeat_interleave with output_size, host->device copies."""
    t = torch.randn(6, 4)
    idx = torch.tensor([0, 2, 5])
    with forbid_host_sync():
        y = t[idx] @ t.T
        y = torch.where(y > 0, y, torch.zeros_like(y)).topk(2, dim=1).values
        r = torch.repeat_interleave(torch.tensor([1, 2]), output_size=3)
        z = torch.ones(3).to("meta")  # host -> device
    assert y.shape == (3, 2) and r.tolist() == [0, 1, 1] and z.device.type == "meta"


def test_forbid_host_sync_leaves_state_after_the_block():
    t = torch.tensor([1.0, 2.0])
    with pytest.raises(dt.StateError):
        with forbid_host_sync():
            t.nonzero()
    assert t.nonzero().shape == (2, 1)  # the mode is gone after the block
