"""The tree-aware indexer kernel (scores + running top-k + slot map in one pass per request)
against the reference (ref_indexer_paged_scores + ref_indexer_gather_scores + the tie rule):
the selection index for index, with planted exact ties, several requests of different lengths,
contexts over several pages and top-k chunks, branch keys and padding rows; the selected scores
within bounds derived from the accumulation order and from FP8 rounding."""
import pytest
import torch
import triton
import triton.language as tl

from dsv4_tree import kernels
from dsv4_tree.kernels import tree_indexer
from dsv4_tree.aot.record import LaunchRecorder
from dsv4_tree.attention import torch_ops
from dsv4_tree.errors import InputError
from dsv4_tree.reference.indexer_topk import ref_indexer_topk
from dsv4_tree.reference.sparse_decode import ref_indexer_gather_scores
from dsv4_tree.serving import KVPool

EPS32 = torch.finfo(torch.float32).eps


def key_pool(rows, kv_dtype, device, page_size=8):
    pool = KVPool(rows.shape[0], rows.shape[1], 0, kv_dtype, page_size, device, torch.float32, kind="index_key")
    pool.write(torch.arange(rows.shape[0], device=device), rows.to(device))
    return pool


def case(sizes, lens, epp, kb, h, d, kv_dtype, seed, device, zero_frac=0.3, pad_rows=1, ints=False):
    """Requests with `sizes` rows and `lens` committed keys behind shuffled entry pages of `epp`
    entries; a share of the committed keys is exactly zero (every row scores them 0: planted
    ties); every row has up to kb own branch keys; `pad_rows` rows of no request at the end.
    `ints`: small integers in keys, queries and weights, so every score is exact in fp32 (and
    in e4m3) and many tie: at any size the order is decided by the tie rule alone (the scale is
    then a power of two, so applying it anywhere rounds nothing).
    Returns (kernel arguments, the exact fp32 key rows)."""
    g = torch.Generator().manual_seed(seed)
    b, n, t = len(sizes), max(sizes), sum(sizes) + pad_rows
    cp = -(-max(max(lens), 1) // epp)
    slots = b * cp * epp + t * kb + 1
    rows = torch.randn(slots, d, generator=g) * torch.exp2(torch.randint(-3, 4, (slots, 1), generator=g).float())
    rows[torch.rand(slots, generator=g) < zero_frac] = 0.0
    pages = torch.randperm(b * cp, generator=g).view(b, cp).to(torch.int32)
    row_req = torch.repeat_interleave(torch.arange(b), torch.tensor(sizes))
    node = torch.cat([torch.arange(s) for s in sizes])
    req_rows = torch.full((b, n), -1, dtype=torch.int32)
    req_rows[row_req, node] = torch.randperm(t - pad_rows, generator=g).to(torch.int32)  # rows in any order
    own = b * cp * epp + torch.arange(t).unsqueeze(1) * kb + torch.arange(kb)
    branch_len = torch.randint(0, kb + 1, (t,), generator=g)
    branch = torch.where(torch.arange(kb) < branch_len.unsqueeze(1), own, -1)
    q = torch.randn(t, h, d, generator=g)
    w = torch.randn(t, h, generator=g)
    if ints:
        rows = torch.randint(-3, 4, rows.shape, generator=g).float()
        q, w = torch.randint(-2, 3, q.shape, generator=g).float(), torch.randint(-2, 3, w.shape, generator=g).float()
    args = dict(q=q.to(device), weights=w.to(device), keys=key_pool(rows, kv_dtype, device), entry_pages=pages.to(device),
                entries_per_page=epp, entry_len=torch.tensor(lens, dtype=torch.int32, device=device),
                branch=branch.to(device), req_rows=req_rows.to(device), scale=2.0 ** -4 if ints else d ** -0.5)
    return args, rows


def candidate_table(args):
    """[T, C + Kb] slots of each row's candidates in block order (-1 = none): test-side only."""
    epp, pages, elen = args["entries_per_page"], args["entry_pages"].long().cpu(), args["entry_len"].cpu()
    t, c = args["q"].shape[0], pages.shape[1] * epp
    table = torch.full((t, c + args["branch"].shape[1]), -1, dtype=torch.int64)
    table[:, c:] = args["branch"].cpu()
    cols = torch.arange(c)
    for b, rows in enumerate(args["req_rows"].cpu().tolist()):
        for r in rows:
            if r >= 0:
                table[r, :c] = torch.where(cols < elen[b], pages[b].repeat_interleave(epp) * epp + cols % epp, -1)
    return table.to(args["q"].device)


def order_bound(args, table):
    """First-order fp32 accumulation bound of every candidate's score, both sides reading the same
    key values: (dI + HI + 3) roundings of the sum of |terms| (the score of |q|, |w|, |keys|)."""
    q, w, keys = args["q"], args["weights"], args["keys"]
    abs_keys = key_pool(keys.read(torch.arange(keys.num_slots, device=q.device)).abs(), "auto", q.device)
    mag = ref_indexer_gather_scores(q.abs(), w.abs(), abs_keys, table, args["scale"])
    return (q.shape[2] + q.shape[1] + 3) * EPS32 * mag


def assert_boundaries_decidable(args, k):
    """Every adjacent pair among the reference's best k + 1 scores of a row is an exact tie or
    further apart than the accumulation bound (otherwise either order is right and the case
    proves nothing). Returns how many rows have an exact tie at the top-k boundary."""
    table = candidate_table(args)
    scores = ref_indexer_gather_scores(args["q"], args["weights"], args["keys"], table, args["scale"])
    bound = order_bound(args, table)
    s, order = torch.sort(scores, dim=1, descending=True, stable=True)
    b = bound.gather(1, order)
    m = min(k + 1, s.shape[1])
    hi, lo = s[:, : m - 1], s[:, 1:m]
    live = torch.isfinite(lo)
    ok = (hi == lo) | (hi - lo > b[:, : m - 1] + b[:, 1:m])
    assert (ok | ~live).all(), f"near-equal scores in a row's best {m}: choose another seed"
    return int(((hi[:, k - 1] == lo[:, k - 1]) & live[:, k - 1]).sum()) if k < s.shape[1] else 0


CASES = [  # sizes, lens (committed keys per request), epp, kb, HI, dI
    ((3, 1, 4), (37, 0, 9), 4, 2, 4, 16),
    ((2, 5), (61, 23), 8, 3, 8, 32),
    ((1,), (5,), 2, 1, 2, 16),
    ((20,), (9,), 4, 40, 2, 16),  # a prefill chunk: rows in groups of 16, more branch keys than KP (merges)
]


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("sizes,lens,epp,kb,h,d", CASES)
@pytest.mark.parametrize("topk", [1, 5, 48])
def test_selection_equals_reference(sizes, lens, epp, kb, h, d, topk, kv_dtype, device):
    args, _ = case(sizes, lens, epp, kb, h, d, kv_dtype, seed=sum(lens) + topk, device=device)
    k = min(topk, args["entry_pages"].shape[1] * epp + kb)
    assert_boundaries_decidable(args, k)
    want = ref_indexer_topk(**args, topk=topk)
    got = kernels.indexer_topk_scores(**args, topk=topk)
    msg = f"{sizes=} {lens=} {epp=} {kb=} {h=} {d=} {topk=} {kv_dtype=}"
    for name, x, y in zip(("selected", "lengths", "ties"), got[:3], want[:3]):
        assert x.dtype == y.dtype and torch.equal(x, y), f"{name} differ: {msg}\n{x}\n{y}"
    assert (got[0][-1] == -1).all() and got[1][-1] == 0, msg  # the padding row selects nothing
    picked = got[0] >= 0
    assert torch.equal(torch.isfinite(got[3]), picked), msg
    bound = order_bound(args, torch.where(picked, got[0], -1))
    assert ((got[3] - want[3]).abs()[picked] <= bound[picked]).all(), msg


def test_planted_ties_are_decided_by_block_order(device):
    # many exact zero scores at the boundary: the earliest columns (committed before branch) win
    args, _ = case((4, 2), (30, 12), 4, 2, 4, 16, "fp8_e4m3", seed=3, device=device, zero_frac=0.6)
    k = 8
    assert assert_boundaries_decidable(args, k) >= 2, "the case plants too few ties at the boundary"
    want = ref_indexer_topk(**args, topk=k)
    got = kernels.indexer_topk(**args, topk=k)
    assert all(torch.equal(x, y) for x, y in zip(got, want[:3])) and want[2].sum() >= 2


def test_fp8_scores_within_the_rounding_bound(device):
    # against the exact fp32 keys: e4m3 keeps 3 mantissa bits (relative error <= 2^-4) and its
    # subnormals step 2^-9 times the block scale s (absolute <= 2^-10 s); ReLU is 1-Lipschitz, so
    # |score_fp8 - score_exact| <= scale * sum_h |w_h| sum_d |q_hd| (2^-4 |k_d| + 2^-10 s), plus the
    # accumulation bound of the exact side
    args, rows = case((3, 2), (40, 17), 4, 2, 4, 32, "fp8_e4m3", seed=9, device=device, zero_frac=0.0)
    sel, _, _, got = kernels.indexer_topk_scores(**args, topk=6)
    blocks = rows.view(rows.shape[0], -1, 128 if rows.shape[1] >= 128 else rows.shape[1])
    s_blk = torch.exp2(torch.ceil(torch.log2(blocks.abs().amax(-1).clamp_min(1e-4) / 448)))
    err_rows = 2 ** -4 * rows.abs() + 2 ** -10 * s_blk.repeat_interleave(blocks.shape[2], 1)
    exact = dict(args, keys=key_pool(rows, "auto", device))
    picked = sel >= 0
    table = torch.where(picked, sel, -1)
    want = ref_indexer_gather_scores(exact["q"], exact["weights"], exact["keys"], table, args["scale"])
    fp8 = ref_indexer_gather_scores(args["q"].abs(), args["weights"].abs(), key_pool(err_rows, "auto", device), table,
                                    args["scale"])
    bound = fp8 + order_bound(exact, table) + order_bound(args, table)
    assert picked.any() and ((got - want).abs()[picked] <= bound[picked]).all()
    assert ((got - want).abs()[picked] > 0).any()  # FP8 did round: the bound is exercised


def test_torch_backend_equals_the_kernel(device):
    args, _ = case((3, 1, 4), (37, 0, 9), 4, 2, 4, 16, "fp8_e4m3", seed=11, device=device)
    assert_boundaries_decidable(args, 5)
    got = kernels.indexer_topk(**args, topk=5)
    for name, x, y in zip(("selected", "lengths", "ties"), torch_ops.indexer_topk(**args, topk=5), got):
        assert torch.equal(x, y), name


def test_bad_input_names_the_argument(device):
    args, _ = case((2,), (9,), 4, 1, 4, 16, "auto", seed=1, device=device)
    bad = {"weights": dict(weights=args["weights"][:, :1]), "branch": dict(branch=args["branch"][:1]),
           "entry_len": dict(entry_len=args["entry_len"].float()), "topk": dict(topk=0),
           "entries_per_page": dict(entries_per_page=0), "req_rows": dict(req_rows=args["req_rows"].view(-1))}
    for name, change in bad.items():
        with pytest.raises(InputError, match=name):
            kernels.indexer_topk(**{**args, "topk": 4, **change})


@triton.jit
def _best_both(kept_ptr, inc_ptr, net_ptr, rank_ptr, KP: tl.constexpr):
    rk = tl.arange(0, KP)
    kept = tl.load(kept_ptr + rk)
    inc = tl.load(inc_ptr + rk)
    tl.store(net_ptr + rk, tree_indexer._best_network(kept, inc, KP))
    tl.store(rank_ptr + rk, tree_indexer._best_rank(kept, inc, KP))


@pytest.mark.parametrize("seed", [0, 1])
def test_the_merge_network_and_its_interpreter_form_agree(seed):
    """The kernel's merge runs the bitonic network on a GPU and a rank count in the interpreter
    (tree_indexer._best): both on the same keys here, with repeated empty keys and equal keys,
    against torch's top-KP of the union."""
    g = torch.Generator().manual_seed(seed)
    kp = 16
    pool = torch.tensor([tree_indexer.NO_KEY] * 3 + torch.randint(-2 ** 40, 2 ** 40, (5,), generator=g).tolist())
    kept = pool[torch.randint(0, pool.numel(), (kp,), generator=g)].sort(descending=True).values
    inc = pool[torch.randint(0, pool.numel(), (kp,), generator=g)]
    net, rank = torch.empty(kp, dtype=torch.int64), torch.empty(kp, dtype=torch.int64)
    _best_both[(1,)](kept, inc, net, rank, KP=kp)
    want = torch.cat([kept, inc]).sort(descending=True).values[:kp]
    assert torch.equal(net, want) and torch.equal(rank, want)


@triton.jit
def _rank_only(kept_ptr, inc_ptr, out_ptr, KP: tl.constexpr):
    rk = tl.arange(0, KP)
    tl.store(out_ptr + rk, tree_indexer._best_rank(tl.load(kept_ptr + rk), tl.load(inc_ptr + rk), KP))


@pytest.mark.parametrize("kp", [1024, 2048])
def test_the_interpreter_merge_runs_at_v4_top_k(kp):
    """V4-Flash's index_topk 512 keeps KP 1024 keys per row, V4-Pro's 1024 KP 2048: the rank
    count works in chunks, so no block passes Triton's 2^20-element limit (one [2 KP, 2 KP] block
    would be 4M / 16M elements)."""
    g = torch.Generator().manual_seed(kp)
    pool = torch.tensor([tree_indexer.NO_KEY] * 64 + torch.randint(-2 ** 40, 2 ** 40, (3 * kp,), generator=g).tolist())
    kept = pool[torch.randint(0, pool.numel(), (kp,), generator=g)].sort(descending=True).values
    inc = pool[torch.randint(0, pool.numel(), (kp,), generator=g)]
    got = torch.empty(kp, dtype=torch.int64)
    _rank_only[(1,)](kept, inc, got, KP=kp)
    assert torch.equal(got, torch.cat([kept, inc]).sort(descending=True).values[:kp]), f"{kp=}"


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8_e4m3"])
def test_v4_flash_top_512_equals_reference(kv_dtype, device):
    """The whole kernel at V4-Flash's indexer: 64 index heads of 128, top 512 (KP 1024) of 1,500
    committed keys and a few branch keys each, an 8-row tree, against the reference index for
    index. Integer scores: exact on both sides, so thousands of boundary pairs are all decidable
    (random scores at this size put some pair within the accumulation bound)."""
    args, _ = case((8,), (1500,), 64, 4, 64, 128, kv_dtype, seed=4, device=device, ints=True)
    # no assert_boundaries_decidable: integer dot products (|sum| < 2^24) are exact in any order
    want = ref_indexer_topk(**args, topk=512)
    got = kernels.indexer_topk_scores(**args, topk=512)
    for name, x, y in zip(("selected", "lengths", "ties"), got[:3], want[:3]):
        assert torch.equal(x, y), f"{name} differ at V4-Flash dims, {kv_dtype=}"
    assert (got[1][:-1] == 512).all() and want[2].sum() > 0, "the case plants ties at the boundary"


@pytest.mark.parametrize("sizes,lens,epp,kb", [((3, 1, 4), (37, 0, 9), 4, 2), ((20,), (9,), 4, 40)])
def test_bf16_queries_over_fp8_keys_take_the_tensor_core_form(sizes, lens, epp, kb, device):
    """bf16 queries over FP8 index keys launch the MMA form (_dot.py): the dot takes the e4m3
    codes (exact in bf16) and applies each key's block scale to its result. Under the interpreter
    this checks that form's values (fp32 dot of the bf16-exact operands: exact products, fp32
    sums); against the reference on the same bf16 query values the only difference is the order
    of the fp32 sums and the scale applied after the sum instead of to each key element, within
    the accumulation bound (order_bound: dI + HI + 3 roundings)."""
    args, _ = case(sizes, lens, epp, kb, 8, 32, "fp8_e4m3", seed=5, device=device)
    args["q"] = args["q"].bfloat16().float()  # the reference and the bound see the bf16 values
    k = 5
    assert_boundaries_decidable(args, k)
    want = ref_indexer_topk(**args, topk=k)
    with LaunchRecorder(run=None) as rec:  # records the launch's constexprs, runs it
        got = kernels.indexer_topk_scores(**dict(args, q=args["q"].bfloat16()), topk=k)
    assert device.type != "cpu" or [(s.constexpr("MMA"), s.constexpr("CODES")) for s in rec.specs] == [(True, True)]
    for name, x, y in zip(("selected", "lengths", "ties"), got[:3], want[:3]):
        assert torch.equal(x, y), name
    picked = got[0] >= 0
    bound = order_bound(args, torch.where(picked, got[0], -1))
    assert picked.any() and ((got[3] - want[3]).abs()[picked] <= bound[picked]).all()
