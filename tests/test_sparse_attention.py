"""The one sparse-attention kernel of a verify layer with a shared list (C128's committed entries,
read once per request for all its rows, through the entry page table) besides each row's own
lists (SWA window, branch entries): Triton against ref_sparse_decode over the same pool bytes,
for trees and chains, shared lists longer than one tile, sinks, windows shorter than the table,
FP8 and bf16 pools, bf16 queries, padding rows; the torch backend's expansion against it too."""
import pytest
import torch

from dsv4_tree import kernels
from dsv4_tree.attention import torch_ops
from dsv4_tree.errors import InputError
from dsv4_tree.reference import ref_sparse_decode
from dsv4_tree.serving import KVPool

EPS32 = torch.finfo(torch.float32).eps


def pool(g, n, d, rope, kv_dtype, device, page_size=16):
    p = KVPool(n, d, rope, kv_dtype, page_size, device, torch.float32)
    rows = torch.randn(n, d, generator=g) * torch.exp2(torch.randint(-2, 3, (n, 1), generator=g).float())
    p.write(torch.arange(n, device=device), rows.to(device))
    return p


def case(sizes, shared, window, kb, h, d, kv_dtype, seed, device, epp=2, pad_rows=1):
    """Requests with `sizes` rows (a size-s chain when `chain`...) and `shared` committed entries
    each (entry pages of `epp` entries, shuffled); every row has a window list [T, window] with a
    ragged length (some far below the table's width) and up to kb own branch entries."""
    g = torch.Generator().manual_seed(seed)
    b, n, t = len(sizes), max(sizes), sum(sizes) + pad_rows
    cp = -(-max(max(shared), 1) // epp)
    swa = pool(g, 3 * window + 7, d, d // 4, kv_dtype, device)
    entries = pool(g, b * cp * epp + t * kb + 5, d, d // 4, kv_dtype, device)
    idx = torch.randint(0, swa.num_slots, (t, window), generator=g, dtype=torch.int32)
    idx[torch.rand(t, window, generator=g) < 0.2] = -1
    lengths = torch.randint(1, window + 1, (t,), generator=g, dtype=torch.int32)
    lengths[-pad_rows:] = 0  # padding rows: empty lists, as the tables give them
    own = b * cp * epp + torch.arange(t).unsqueeze(1) * kb + torch.arange(kb)
    branch_len = torch.randint(0, kb + 1, (t,), generator=g, dtype=torch.int32)
    row_req = torch.repeat_interleave(torch.arange(b), torch.tensor(sizes))
    node = torch.cat([torch.arange(s) for s in sizes])
    req_rows = torch.full((b, n), -1, dtype=torch.int32)
    req_rows[row_req, node] = torch.randperm(t - pad_rows, generator=g).to(torch.int32)
    pages = torch.randperm(b * cp, generator=g).view(b, cp).to(torch.int32)
    q = torch.randn(t, h, d, generator=g)
    return dict(q=q.to(device), kv=swa, indices=idx.to(device), lengths=lengths.to(device),
                sinks=torch.randn(h, generator=g).to(device), scale=d ** -0.5, extra_kv=entries,
                extra_indices=own.to(torch.int32).to(device), extra_lengths=branch_len.to(device),
                shared_pages=pages.to(device), shared_per_page=epp,
                shared_len=torch.tensor(shared, dtype=torch.int32, device=device), req_rows=req_rows.to(device))


def out_bound(args, want):
    """First-order fp32 bound on |out - ref| for the same key values in another summation order:
    each logit's dot (d roundings of scale * sum |q||k|) moves a softmax weight p by <= 2 p |dlogit|
    and the weighted sum of K keys adds (K + 3) roundings; both times max |v| (weights sum to 1)."""
    q, d = args["q"].float(), args["q"].shape[2]
    kmax = max(float(args["kv"].read(torch.arange(args["kv"].num_slots, device=q.device)).abs().max()),
               float(args["extra_kv"].read(torch.arange(args["extra_kv"].num_slots, device=q.device)).abs().max()))
    n_keys = args["indices"].shape[1] + args["extra_indices"].shape[1] + args["shared_pages"].shape[1] * args["shared_per_page"]
    dlogit = d * EPS32 * args["scale"] * float(q.abs().sum(-1).max()) * kmax  # sum_d |q_d||k_d| <= |q|_1 max|k|
    return kmax * (2 * dlogit + (n_keys + 3) * EPS32)


def assert_close(got, want, bound, msg):
    fin = torch.isfinite(want)
    assert torch.equal(got[~fin], want[~fin]), f"non-finite entries differ: {msg}"
    err = float((got.float() - want.float())[fin].abs().max())
    assert err <= bound, f"error {err:.2e} > bound {bound:.2e}: {msg}"


CASES = [  # sizes (rows per request; 1-row requests are chains of the decode kind), shared entries, window, kb
    ((5, 3, 1), (40, 7, 0), 20, 2),  # shared lists over 2 and 3 tiles of 16, one request without any
    ((8,), (33,), 128, 3),  # a 128-wide window table, lengths mostly far below it
    ((4, 4), (17, 16), 12, 1),
]


@pytest.mark.parametrize("kv_dtype", ["auto", "bfloat16", "fp8_e4m3"])
@pytest.mark.parametrize("sizes,shared,window,kb", CASES)
def test_shared_list_kernel_matches_reference(sizes, shared, window, kb, kv_dtype, device):
    args = case(sizes, shared, window, kb, 4, 64, kv_dtype, seed=sum(shared) + window, device=device)
    want_out, want_lse = ref_sparse_decode(**args)
    got_out, got_lse = kernels.sparse_decode(**args)
    msg = f"{sizes=} {shared=} {window=} {kb=} {kv_dtype=}"
    assert_close(got_out, want_out, out_bound(args, want_out), msg)
    # lse: the log of the same sum, same bound relative to its largest magnitude (1e-5, test_sparse_decode)
    assert_close(got_lse, want_lse, 1e-5 * float(want_lse[torch.isfinite(want_lse)].abs().max()), msg)
    assert torch.equal(got_out[-1], torch.zeros_like(got_out[-1])) and torch.isinf(got_lse[-1]).all(), msg
    tor_out, tor_lse = torch_ops.sparse_decode(**args)
    assert_close(tor_out, want_out, out_bound(args, want_out), f"torch backend {msg}")


def test_bf16_queries_and_output(device):
    args = case((6, 2), (35, 9), 24, 2, 4, 64, "fp8_e4m3", seed=5, device=device)
    args["q"] = args["q"].bfloat16()
    want, _ = ref_sparse_decode(**{**args, "q": args["q"].float()})
    got, _ = kernels.sparse_decode(**args)
    assert got.dtype == torch.bfloat16
    # one cast of the fp32 result to bf16: the interpreter truncates (one bf16 step, 2^-7 relative),
    # a GPU rounds to nearest (2^-8), on top of the fp32 bound
    excess = ((got.float() - want).abs() - (2 ** -7 * want.abs() + out_bound(args, want))).max()
    assert excess <= 0


def test_shared_list_is_every_rows_committed_entries(device):
    # the shared list equals listing the request's entries in each row's own extra list
    args = case((3, 2), (21, 5), 10, 2, 4, 32, "fp8_e4m3", seed=8, device=device, pad_rows=0)
    e = args["shared_per_page"]
    per_row = torch.full((args["q"].shape[0], 21 + 2), -1, dtype=torch.int32, device=device)
    for b, rows in enumerate(args["req_rows"].tolist()):
        j = torch.arange(int(args["shared_len"][b]), device=device)
        slots = args["shared_pages"][b].long()[j // e] * e + j % e
        for r in (r for r in rows if r >= 0):
            own = args["extra_indices"][r, : int(args["extra_lengths"][r])]
            per_row[r, : j.numel() + own.numel()] = torch.cat([slots.int(), own])
    flat = {k: v for k, v in args.items() if k not in ("shared_pages", "shared_per_page", "shared_len", "req_rows")}
    flat.update(extra_indices=per_row, extra_lengths=torch.full_like(args["extra_lengths"], per_row.shape[1]))
    want, _ = kernels.sparse_decode(**flat)
    got, _ = kernels.sparse_decode(**args)
    assert_close(got, want, out_bound(args, want), "shared list vs per-row lists")


def test_bad_shared_input(device):
    args = case((2,), (5,), 8, 1, 4, 32, "auto", seed=2, device=device)
    with pytest.raises(InputError, match="together"):
        kernels.sparse_decode(**{**args, "req_rows": None})
    with pytest.raises(InputError, match="shared_len"):
        kernels.sparse_decode(**{**args, "shared_len": args["shared_len"].float()})
    with pytest.raises(InputError, match="extra pool"):
        kernels.sparse_decode(**{**args, "extra_kv": None, "extra_indices": None, "extra_lengths": None})
    with pytest.raises(InputError, match="shared_per_page"):
        kernels.sparse_decode(**{**args, "shared_per_page": 0})
