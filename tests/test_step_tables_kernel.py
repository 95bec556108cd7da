"""The Triton table build (kernels/table_build.py) equals the torch build (serving/tables.py,
itself equal to the host reference: test_device_tables.py) field for field, bit for bit,
padding rows and requests included, over generated batches and page-table histories; its page
updates equal the torch scatter; it launches three kernels whatever the batch; bad inputs are
refused."""
import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_device_tables import MAX_NODES, MAX_POS, MAX_REQ, RECENT, commit_and_reuse, draw_batch, layout_for

import dsv4_tree as dt
from dsv4_tree import kernels
from dsv4_tree.diagnostics import LaunchCounter
from dsv4_tree.serving.buckets import step_shapes
from dsv4_tree.serving.pages import PageTable
from dsv4_tree.serving.pools import Layout
from dsv4_tree.serving.step import DevicePages, build_from, schedule, upload


def assert_same(got, want, label: str) -> None:
    """Every tensor of two build results equal (dtype, shape, values), recursively."""
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, f"{label}: {got.dtype} {tuple(got.shape)} " \
                                                                    f"vs {want.dtype} {tuple(want.shape)}"
        assert torch.equal(got, want), f"{label}: {got} vs {want}"
    elif isinstance(want, dict):
        assert set(got) == set(want), label
        for k in want:
            assert_same(got[k], want[k], f"{label}.{k}")
    elif dataclasses.is_dataclass(want):
        for f in dataclasses.fields(want):
            assert_same(getattr(got, f.name), getattr(want, f.name), f"{label}.{f.name}")
    else:
        assert got == want, f"{label}: {got} vs {want}"


def both_builds(pages, torch_pages, kernel_pages, layout, rows, seq_lens, trees, bucketed):
    pages.ensure(rows, [p + t.num_nodes for p, t in zip(seq_lens, trees)], [p - RECENT for p in seq_lens])
    sizes = [t.num_nodes for t in trees]
    shapes = step_shapes(sizes, seq_lens, layout, MAX_NODES if bucketed else None)
    step = schedule(rows, seq_lens, trees, sizes, pages.take_updates(), shapes)
    want = build_from(upload(step, torch_pages, "cpu"), shapes, torch_pages, layout)
    got = build_from(upload(step, kernel_pages, "cpu"), shapes, kernel_pages, layout)
    assert torch.equal(kernel_pages.pages.page_table, torch_pages.pages.page_table)
    assert torch.equal(kernel_pages.pages.swa_pages, torch_pages.pages.swa_pages)
    return got, want


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_triton_build_equals_the_torch_build(data):
    ps = data.draw(st.sampled_from([256, 16]), label="page_size")
    bucketed = data.draw(st.booleans(), label="bucketed")
    layout = layout_for(ps)
    pages = PageTable(MAX_REQ, MAX_POS, ps, layout.num_token_pages, layout.num_recent_pages)
    torch_pages = DevicePages(MAX_REQ, pages.pages_per_request, layout.num_token_pages, ps, "cpu")
    kernel_pages = DevicePages(MAX_REQ, pages.pages_per_request, layout.num_token_pages, ps, "cpu")
    kernel_pages.use_kernels(kernels)
    rows, seq_lens, trees = draw_batch(data, pages)
    label = f"{ps=} {bucketed=} {seq_lens=} sizes={[t.num_nodes for t in trees]}"
    got, want = both_builds(pages, torch_pages, kernel_pages, layout, rows, seq_lens, trees, bucketed)
    assert_same(got, want, label)
    # a commit, a released and reused row, the next step: both device copies stay equal
    rows, grown, trees = commit_and_reuse(data, pages, rows, seq_lens, trees)
    got, want = both_builds(pages, torch_pages, kernel_pages, layout, rows, grown, trees, bucketed)
    assert_same(got, want, f"second step {label} {grown=}")


@pytest.mark.parametrize("ratios", [{}, {4: True}, {128: False}, {4: True, 16: False}])
def test_other_ratio_sets_and_a_block_spanning_pages(ratios):
    """No ratio, one ratio, and a ratio above the page size (one entry per page run)."""
    ps = 16
    pages_n = MAX_REQ * (-(-MAX_POS // ps) + 1)
    layout = Layout(ps, 8, RECENT, ratios, pages_n, MAX_NODES, MAX_REQ, pages_n)
    pages = PageTable(MAX_REQ, MAX_POS, ps, layout.num_token_pages, layout.num_recent_pages)
    torch_pages = DevicePages(MAX_REQ, pages.pages_per_request, layout.num_token_pages, ps, "cpu")
    kernel_pages = DevicePages(MAX_REQ, pages.pages_per_request, layout.num_token_pages, ps, "cpu")
    kernel_pages.use_kernels(kernels)
    rows = [pages.admit(), pages.admit()]
    trees = [dt.DraftTree(torch.tensor([5, 6, 7, 8, 9]), torch.tensor([-1, 0, 0, 1, 3])),
             dt.DraftTree(torch.tensor([4, 3]), torch.tensor([-1, 0]))]
    got, want = both_builds(pages, torch_pages, kernel_pages, layout, rows, [127, 14], trees, True)
    assert_same(got, want, f"{ratios}")


def small_step():
    layout = layout_for(16)
    pages = PageTable(MAX_REQ, MAX_POS, 16, layout.num_token_pages, layout.num_recent_pages)
    dev = DevicePages(MAX_REQ, pages.pages_per_request, layout.num_token_pages, 16, "cpu")
    dev.use_kernels(kernels)
    rows = [pages.admit() for _ in range(3)]
    trees = [dt.DraftTree(torch.tensor([5, 6, 7]), torch.tensor([-1, 0, 0])) for _ in rows]
    seq = [40, 300, 9]
    pages.ensure(rows, [p + 3 for p in seq], [p - RECENT for p in seq])
    shapes = step_shapes([3] * 3, seq, layout, MAX_NODES)
    return layout, dev, schedule(rows, seq, trees, [3] * 3, pages.take_updates(), shapes), shapes


def test_three_launches_whatever_the_batch():
    layout, dev, step, shapes = small_step()
    with LaunchCounter() as c:
        build_from(upload(step, dev, "cpu"), shapes, dev, layout)
    assert c.by_name == {"triton._apply_pages_kernel": 1, "triton._rows_kernel": 1,
                         "triton._requests_kernel": 1}, dict(c.by_name)


def test_bad_inputs_are_refused():
    layout, dev, step, shapes = small_step()
    inputs = upload(step, dev, "cpu")
    with pytest.raises(dt.InputError, match="inputs must be"):
        kernels.step_tables(inputs[:-1], shapes, dev.pages, layout)
    with pytest.raises(dt.InputError, match="inputs must have dtype"):
        kernels.step_tables(inputs.long(), shapes, dev.pages, layout)
    bad = dataclasses.replace(dev.pages, page_table=dev.pages.page_table.long())
    with pytest.raises(dt.InputError, match="page_table must have dtype"):
        kernels.step_tables(inputs, shapes, bad, layout)
    with pytest.raises(dt.InputError, match="page updates"):
        kernels.apply_page_updates(inputs, inputs.shape[0] - 1, 1, 0, dev.pages)
    many = dataclasses.replace(layout, ratios={4: True, 16: False, 128: False})
    with pytest.raises(dt.ConfigError, match="at most 2 compression ratios"):
        kernels.step_tables(inputs, shapes, dev.pages, many)


def test_on_meta_the_build_allocates_its_tables_and_launches_nothing():
    layout, dev, step, shapes = small_step()
    want = build_from(upload(step, dev, "cpu"), shapes, dev, layout)
    meta_pages = dataclasses.replace(dev.pages, page_table=dev.pages.page_table.to("meta"),
                                     swa_pages=dev.pages.swa_pages.to("meta"))
    inputs = step.buffer[: 3 * shapes.requests + 2 * shapes.rows].to("meta")
    with LaunchCounter(device="meta") as c:
        got = kernels.step_tables(inputs, shapes, meta_pages, layout)
    assert c.total == 0, dict(c.by_name)
    for g, w in zip(tensor_leaves(got), tensor_leaves(want), strict=True):
        assert g.device.type == "meta" and g.dtype == w.dtype and g.shape == w.shape


def tensor_leaves(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, dict):
        for k in sorted(x, key=str):
            yield from tensor_leaves(x[k])
    elif dataclasses.is_dataclass(x):
        for f in dataclasses.fields(x):
            yield from tensor_leaves(getattr(x, f.name))
