"""The device-built verify tables (serving/tables.py) equal the reference host builder
(reference/tables.py) bit for bit, over generated batches and page-table histories."""
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dsv4_tree as dt
from dsv4_tree.reference.tables import ref_build_tables
from dsv4_tree.serving.buckets import step_shapes
from dsv4_tree.serving.pages import PageTable
from dsv4_tree.serving.pools import Layout
from dsv4_tree.serving.step import DevicePages, build_step, schedule
from dsv4_tree.serving.tables import entry_slot_of

MAX_POS, MAX_REQ, MAX_NODES, WINDOW = 1024, 5, 64, 8
RATIOS = {4: True, 128: False}
RECENT = 2 * 128  # >= window and every compressor's source rows


def layout_for(ps: int) -> Layout:
    pages = MAX_REQ * (-(-MAX_POS // ps) + 1)
    return Layout(ps, WINDOW, RECENT, RATIOS, pages, MAX_NODES, MAX_REQ, pages)


@st.composite
def tree(draw, root: int):
    """1-64 nodes; each parent among the `reach` latest nodes (reach 1: a chain, deep paths)."""
    n = draw(st.integers(1, MAX_NODES))
    reach = draw(st.sampled_from([1, 2, 4, n]))
    parents = [-1] + [draw(st.integers(max(0, i - reach), i - 1)) for i in range(1, n)]
    toks = [root] + [draw(st.integers(2, 500)) for _ in range(1, n)]
    return dt.DraftTree(torch.tensor(toks), torch.tensor(parents))


def context(draw):
    """P near page, C4 and C128 boundaries (the root or a deep node closes a block) or anywhere."""
    base = draw(st.sampled_from([0, 1, 3, 4, 7, 127, 128, 255, 256, 300, 511, 640, 900]))
    return min(MAX_POS - MAX_NODES - 40, base + draw(st.integers(-3, 3)) % 40)


def compare(got: dict, ref, label: str) -> None:
    t = ref.positions.shape[0]
    for name in ("input_ids", "positions", "out_loc", "swa_index", "swa_len"):
        assert torch.equal(got[name][:t], getattr(ref, name)), f"{label}: {name}"
    g = got["groups"]
    for m, rc in ref.compress.items():
        ct = got["compress"][m]
        closing = ct.closes[:t].nonzero().flatten()
        assert torch.equal(closing, rc.closing), f"{label}: C{m} closing rows"
        for name in ("entry_out", "block_start", "src"):
            assert torch.equal(getattr(ct, name)[closing], getattr(rc, name)), f"{label}: C{m} {name}"
        # a row's entries: its request's committed ones, then its branch ones, -1 after
        for row in range(t):
            b = int(g.row_req[row])
            n_e, n_b = int(ct.entry_len[b]), int(ct.branch_len[row])
            committed = entry_slot_of(ct, torch.tensor(b), torch.arange(n_e))
            lst = torch.cat([committed, ct.branch[row, :n_b]])
            assert (ct.branch[row, n_b:] == -1).all(), f"{label}: C{m} pad"
            assert ct.entry_pages.shape[1] * ct.entries_per_page >= n_e, f"{label}: C{m} page form too narrow"
            want = rc.entries[row]
            assert int(rc.entry_len[row]) == n_e + n_b, f"{label}: C{m} row {row} length"
            assert torch.equal(lst, want[: n_e + n_b]) and (want[n_e + n_b:] == -1).all(), f"{label}: C{m} row {row}"


def check_padding(got: dict, real_rows: int, layout: Layout) -> None:
    pad = slice(real_rows, None)
    assert (got["out_loc"][pad] == layout.trash_recent_slot).all() and (got["swa_len"][pad] == 0).all()
    assert (got["groups"].row_req[pad] == -1).all()
    for m, ct in got["compress"].items():
        assert not ct.closes[pad].any() and (ct.branch_len[pad] == 0).all()
        assert (ct.entry_out[pad] == layout.trash_entry_slot(m)).all()


def one_step(pages, dev_pages, layout, rows, seq_lens, trees, bucketed: bool, label: str) -> None:
    pages.ensure(rows, [p + t.num_nodes for p, t in zip(seq_lens, trees)], [p - RECENT for p in seq_lens])
    sizes = [t.num_nodes for t in trees]
    shapes = step_shapes(sizes, seq_lens, layout, MAX_NODES if bucketed else None)
    got = build_step(schedule(rows, seq_lens, trees, sizes, pages.take_updates(), shapes), dev_pages, layout, "cpu")
    ref = ref_build_tables(trees, seq_lens, rows, pages, layout)
    compare(got, ref, label)
    check_padding(got, sum(sizes), layout)


def draw_batch(data, pages):
    """1-3 admitted requests at drawn contexts with drawn trees -> (rows, seq_lens, trees)."""
    bs = data.draw(st.integers(1, 3), label="bs")
    rows = [pages.admit() for _ in range(bs)]
    return rows, [context(data.draw) for _ in range(bs)], [data.draw(tree(5 + b)) for b in range(bs)]


def commit_and_reuse(data, pages, rows, seq_lens, trees):
    """A commit (pages freed past the new lengths, recent pages before them), the first
    request released and its row reused at a new context, new trees -> (rows, seq_lens, trees)."""
    grown = [p + data.draw(st.integers(1, t.num_nodes)) for p, t in zip(seq_lens, trees)]
    pages.shrink(rows, grown)
    pages.evict(rows, [n - RECENT for n in grown])
    pages.release(rows[0])
    rows[0] = pages.admit()
    grown[0] = context(data.draw)
    pages.ensure([rows[0]], [grown[0]], [grown[0] - RECENT])
    return rows, grown, [data.draw(tree(7 + b)) for b in range(len(rows))]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_device_tables_equal_the_reference_builder(data):
    ps = data.draw(st.sampled_from([256, 16]), label="page_size")
    bucketed = data.draw(st.booleans(), label="bucketed")
    layout = layout_for(ps)
    pages = PageTable(MAX_REQ, MAX_POS, ps, layout.num_token_pages, layout.num_recent_pages)
    dev_pages = DevicePages(MAX_REQ, pages.pages_per_request, layout.num_token_pages, ps, "cpu")
    rows, seq_lens, trees = draw_batch(data, pages)
    label = f"{ps=} {bucketed=} {seq_lens=} sizes={[t.num_nodes for t in trees]}"
    one_step(pages, dev_pages, layout, rows, seq_lens, trees, bucketed, label)
    # a commit (pages freed past the new length, recent pages before it), a released request
    # whose row and pages are reused, then the next step: stale device entries are never read
    rows, grown, trees = commit_and_reuse(data, pages, rows, seq_lens, trees)
    one_step(pages, dev_pages, layout, rows, grown, trees, bucketed, f"second step {label} {grown=}")


def test_sglang_form_page_tables_give_the_same_slots():
    """TokenPages.from_sglang (per-position req_to_token, per-slot full_to_swa) reads the slots the
    page form holds."""
    from dsv4_tree.serving.tables import TokenPages

    layout = layout_for(16)
    pages = PageTable(MAX_REQ, MAX_POS, 16, layout.num_token_pages, layout.num_recent_pages)
    rows = [pages.admit(), pages.admit()]
    pages.ensure(rows, [300, 77], [300 - RECENT, 77 - RECENT])
    sg = TokenPages.from_sglang(pages.req_to_token(), pages.full_to_swa_mapping(), 16)
    pos = torch.arange(300)
    for r, n in zip(rows, (300, 77)):
        want = pages.token_slots(torch.full((n,), r), pos[:n])
        got = sg.token_slots(torch.full((n,), r), pos[:n])
        assert torch.equal(got, want)
        assert torch.equal(sg.swa_slots(got), pages.recent_slots(want))
