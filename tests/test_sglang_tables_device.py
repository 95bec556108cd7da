"""The plug-in's tree tables (pure torch, no SGLang import) on PyTorch's `meta` device: every op
stays on the inputs' device and none reads device values on the host (a `.item()`, `.tolist()`,
`nonzero` or data-dependent shape would fail here), as SGLang's eager verify on a GPU needs."""
import torch

from dsv4_tree.sglang_plugin.tables import build_tree_verify_tables, tree_c128_page_indices


def test_tree_tables_on_meta_device():
    bs, n, rows, max_len = 2, 8, 3, 2048
    dev = torch.device("meta")
    tables = build_tree_verify_tables(
        req_to_token=torch.empty(rows, max_len, dtype=torch.int32, device=dev),
        full_to_swa_index_mapping=torch.empty(rows * max_len + 1, dtype=torch.int64, device=dev),
        req_pool_indices=torch.empty(bs, dtype=torch.int32, device=dev),
        seq_lens=torch.empty(bs, dtype=torch.int32, device=dev),
        retrieve_next_token=torch.empty(bs, n, dtype=torch.int64, device=dev),
        retrieve_next_sibling=torch.empty(bs, n, dtype=torch.int64, device=dev),
        swa_window=128, scratch_start={4: 4096, 128: 128}, scratch_per_request=n)
    t = bs * n
    assert tables.swa_page_indices.shape == (t, 128) and tables.swa_page_indices.device == dev
    assert tables.c4_out_loc.shape == (t,) and tables.c128_branch.shape == (t, 1) and tables.c4_branch.shape == (t, 2)
    for f in tables.__dataclass_fields__:
        assert getattr(tables, f).device == dev, f
    c128 = tree_c128_page_indices(torch.empty(t, 64, dtype=torch.int32, device=dev), tables.c128_branch,
                                  tables.seq_lens_casual, tables.c128_committed)
    assert c128.shape == (t, 64) and c128.dtype == torch.int32 and c128.device == dev


def test_tree_links_depths_and_entry_slots():
    """parents from SGLang's links equal the project's checked inversion; entry slots: chains at
    their committed home (SGLang's raw // m), no two closing nodes of a batch on one slot."""
    from dsv4_tree.sglang_plugin.tables import depths, parents_from_retrieve, tree_entry_out_loc
    from dsv4_tree.tree import parents_from_links, trees_to_tensors
    from dsv4_tree.tree.simulate import eagle_tree

    for n, topk in ((1, 2), (2, 2), (8, 4), (10, 3), (16, 4)):
        trees = [eagle_tree(7, n, topk=topk, seed=s) for s in range(3)]
        ts = trees_to_tensors(trees, [0, 5, 9])
        parents = parents_from_retrieve(ts["retrieve_next_token"], ts["retrieve_next_sibling"])
        assert torch.equal(parents, parents_from_links(ts["retrieve_next_token"], ts["retrieve_next_sibling"]))
        assert torch.equal(parents, ts["parents"])
        assert torch.equal(depths(parents), torch.stack([t.depth for t in trees]))
        rows, max_len = 4, 1024
        req_to_token = (torch.arange(rows * max_len, dtype=torch.int32) + 256).view(rows, max_len)
        for P in (0, 3, 125, 126, 127, 250):
            seq_lens = torch.full((3,), P)
            rpi = torch.tensor([3, 1, 2])
            d = depths(parents)
            for m in (4, 128):
                loc = tree_entry_out_loc(req_to_token, rpi, seq_lens, d, m, scratch_start=10_000, scratch_per_request=n)
                closing = ((seq_lens.view(3, 1) + d + 1) % m == 0).view(-1)
                written = loc[closing]
                assert written.unique().numel() == written.numel()
                assert (loc[~closing] == 0).all()
        chain = torch.arange(-1, n - 1).expand(2, n)
        d = depths(chain)
        loc = tree_entry_out_loc(req_to_token, torch.tensor([1, 2]), torch.tensor([3, 126]), d, 4, 10_000, n)
        raw = torch.stack([req_to_token[1, 3:3 + n], req_to_token[2, 126:126 + n]]).to(torch.int64)
        closing = ((torch.tensor([3, 126]).view(2, 1) + d + 1) % 4 == 0)
        assert torch.equal(loc.view(2, n), torch.where(closing, raw // 4, 0))
