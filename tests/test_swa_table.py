"""tree_swa_page_indices against a transcription of SGLang's chain rule (chains, and per path for trees)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4_tree.diagnostics import forbid_host_sync
from dsv4_tree.errors import InputError
from dsv4_tree.serving import tree_swa_page_indices


def sglang_chain_rule(req_to_token, full_to_swa_mapping, req_pool_indices_repeated, seq_lens_casual,
                      swa_window, page_index_aligned_size):
    """SGLang's `build_causal_swa_page_indices`, restated one element at a time: row t (causal
    length L) holds at column k < W the SWA slot of position L-1-k of its request
    (`full_to_swa_mapping[req_to_token[req, L-1-k]]`), -1 when that position is negative; the
    width is W rounded up to a multiple of `page_index_aligned_size`, extra columns -1."""
    width = -(-swa_window // page_index_aligned_size) * page_index_aligned_size
    out = torch.full((len(seq_lens_casual), width), -1, dtype=torch.int32)
    for t, (req, length) in enumerate(zip(req_pool_indices_repeated.tolist(), seq_lens_casual.tolist())):
        for k in range(swa_window):
            pos = length - 1 - k
            if pos >= 0:
                out[t, k] = int(full_to_swa_mapping[int(req_to_token[req, pos])])
    return out


def paged_tables(lengths, page_size, g, rows=None):
    """req_to_token with SGLang's alignment (a position's offset in its page = its slot's offset),
    pages drawn at random from a pool; full_to_swa_mapping page-aligned into a separate SWA pool
    of other page numbers, with SGLang's trailing -1 sentinel."""
    rows = rows or len(lengths)
    max_len = max(lengths)
    pages_per_row = -(-max_len // page_size)
    num_pages = rows * pages_per_row + 3
    page_of = torch.randperm(num_pages, generator=g)[: rows * pages_per_row].view(rows, pages_per_row)
    pos = torch.arange(pages_per_row * page_size)
    req_to_token = (page_of[:, pos // page_size] * page_size + pos % page_size).to(torch.int32)
    swa_page = torch.randperm(num_pages, generator=g) + 1000
    full = torch.arange(num_pages * page_size)
    mapping = swa_page[full // page_size] * page_size + full % page_size
    return req_to_token, torch.cat([mapping, torch.tensor([-1])])


def random_parents(bs, n, g, chain=False):
    if chain:
        return torch.arange(-1, n - 1).expand(bs, n).clone()
    par = torch.full((bs, n), -1, dtype=torch.int64)
    for i in range(1, n):
        par[:, i] = torch.randint(0, i, (bs,), generator=g)
    return par


def path_of(parents_row: list[int], i: int) -> list[int]:
    path = [i]
    while parents_row[path[-1]] >= 0:
        path.append(parents_row[path[-1]])
    return path[::-1]


# (seq_lens, N, W): windows longer than P and than P + N, P = 0, chains deeper than W
SHAPES = [([5, 0, 40], 6, 8), ([3, 300, 17], 12, 128), ([0, 2], 20, 8), ([700, 1], 9, 3), ([31, 64], 5, 64)]


@pytest.mark.parametrize("page_size", [256, 16])
@pytest.mark.parametrize("seq_lens,n,window", SHAPES)
@pytest.mark.parametrize("aligned", [64, 16])
def test_chain_equals_sglang_rule(seq_lens, n, window, page_size, aligned):
    g = torch.Generator().manual_seed(n * 1000 + window + page_size)
    bs = len(seq_lens)
    req_to_token, mapping = paged_tables([p + n for p in seq_lens], page_size, g, rows=bs + 2)
    req_pool_indices = torch.randperm(bs + 2, generator=g)[:bs]
    P = torch.tensor(seq_lens)
    chain = random_parents(bs, n, g, chain=True)
    got = tree_swa_page_indices(req_to_token, mapping, req_pool_indices, P, chain, window, aligned)
    lengths = (P.view(bs, 1) + torch.arange(1, n + 1)).view(-1)  # L = P + j + 1
    rows_req = req_pool_indices.repeat_interleave(n)
    want = sglang_chain_rule(req_to_token, mapping, rows_req, lengths, window, aligned)
    assert got.dtype == torch.int32 and got.shape == (bs * n, -(-window // aligned) * aligned)
    assert torch.equal(got, want), f"{seq_lens=} {n=} {window=} {page_size=} {aligned=}"
    assert (got[:, window:] == -1).all()


def per_path_chain_rule(req_to_token, mapping, req_pool_indices, seq_lens, parents, window):
    """The chain rule applied, for each row (b, i), to a request row holding the committed slots
    then path(i)'s draft slots laid out consecutively."""
    bs, n = parents.shape
    chain_rows = torch.full((bs * n, req_to_token.shape[1]), -1, dtype=torch.int32)
    lengths = []
    for b, P in enumerate(seq_lens):
        src = req_to_token[req_pool_indices[b]]
        for i in range(n):
            path = path_of(parents[b].tolist(), i)
            chain_rows[b * n + i, :P] = src[:P]
            chain_rows[b * n + i, P : P + len(path)] = src[P + torch.tensor(path)]
            lengths.append(P + len(path))
    return sglang_chain_rule(chain_rows, mapping, torch.arange(bs * n), torch.tensor(lengths), window, 64)


@pytest.mark.parametrize("page_size", [256, 16])
@pytest.mark.parametrize("seq_lens,n,window", SHAPES)
def test_tree_rows_equal_the_chain_rule_on_their_path(seq_lens, n, window, page_size):
    g = torch.Generator().manual_seed(n * 7 + window + page_size)
    bs = len(seq_lens)
    req_to_token, mapping = paged_tables([p + n for p in seq_lens], page_size, g)
    req_pool_indices = torch.arange(bs).flip(0)
    parents = random_parents(bs, n, g)
    P = torch.tensor(seq_lens)
    got = tree_swa_page_indices(req_to_token, mapping, req_pool_indices, P, parents, window)
    want = per_path_chain_rule(req_to_token, mapping, req_pool_indices, seq_lens, parents, window)
    assert torch.equal(got, want), f"{seq_lens=} {n=} {window=} {page_size=} parents={parents.tolist()}"


@settings(max_examples=60, deadline=None)
@given(data=st.data(), bs=st.integers(1, 3), n=st.integers(1, 12), window=st.integers(1, 40),
       page_size=st.sampled_from([16, 256]))
def test_tree_rows_property(data, bs, n, window, page_size):
    seq_lens = data.draw(st.lists(st.integers(0, 60), min_size=bs, max_size=bs), label="seq_lens")
    parents = torch.tensor([[-1] + [data.draw(st.integers(0, i - 1)) for i in range(1, n)] for _ in range(bs)])
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1), label="seed"))
    req_to_token, mapping = paged_tables([p + n for p in seq_lens], page_size, g)
    req_pool_indices = torch.randperm(bs, generator=g)
    P = torch.tensor(seq_lens)
    got = tree_swa_page_indices(req_to_token, mapping, req_pool_indices, P, parents, window)
    want = per_path_chain_rule(req_to_token, mapping, req_pool_indices, seq_lens, parents, window)
    assert torch.equal(got, want), f"{seq_lens=} {n=} {window=} {page_size=} parents={parents.tolist()}"


def test_siblings_differ_and_see_no_sibling():
    """A hand-checked tree: root 0, children 1 and 2, node 3 under 2; P = 2, W = 4, identity tables."""
    req_to_token = torch.arange(100, dtype=torch.int32).view(1, 100)
    mapping = torch.arange(100) + 500
    got = tree_swa_page_indices(req_to_token, mapping, torch.tensor([0]), torch.tensor([2]),
                                torch.tensor([[-1, 0, 0, 2]]), 4)
    want = [[502, 501, 500, -1], [503, 502, 501, 500], [504, 502, 501, 500], [505, 504, 502, 501]]
    assert got[:, :4].tolist() == want and (got[:, 4:] == -1).all() and got.shape == (4, 64)


def test_builder_does_not_synchronise_and_checks_inputs():
    g = torch.Generator().manual_seed(0)
    req_to_token, mapping = paged_tables([40, 40], 16, g)
    args = (req_to_token, mapping, torch.tensor([1, 0]), torch.tensor([30, 3]))
    parents = random_parents(2, 10, g)
    with forbid_host_sync():
        out = tree_swa_page_indices(*args, parents, 8)
    assert out.shape == (20, 64)
    with pytest.raises(InputError, match="parents"):
        tree_swa_page_indices(*args, parents.to(torch.int32), 8)
    with pytest.raises(InputError, match="seq_lens"):
        tree_swa_page_indices(req_to_token, mapping, torch.tensor([1, 0]), torch.tensor([30]), parents, 8)
    with pytest.raises(InputError, match="swa_window"):
        tree_swa_page_indices(*args, parents, 0)
