"""The tree backend's C4 indexer (per-branch candidates) against SGLang 0.5.23's own
`forward_c4_indexer` on the CPU (its torch logits reference, its torch top-k transform), on real
DeepSeekV4TokenToKVPools: every tree row's selected C4 entries are SGLang's selection for that
row's root-to-node path laid out as a chain (a chain verify of that path, on a pool holding only
that path's entries), and the sparse attention's indices address the same entry bytes. Contexts
hold more C4 blocks than index_topk (512), so the selection depends on the scores, and the trees
close C4 blocks at nodes that are not the first at their depth (entries in scratch)."""
import pytest
import torch
from sglang.srt.layers.attention import deepseek_v4_backend as dsv4
from sglang.srt.layers.attention.dsa.dsa_topk_backend import DSATopKBackend

from dsv4_tree.attention.backend import get_backend
from dsv4_tree.serving.records import IndexKeyLayout, quantize_rows
from dsv4_tree.sglang_plugin import install_move_kv_cache
from dsv4_tree.sglang_plugin.backend import TreeDeepseekV4AttnBackend
from dsv4_tree.sglang_plugin.scratch import layer_buffers
from dsv4_tree.sglang_plugin.tables import parents_from_retrieve
from plugin_probe import dsv4_dir
from sgl_cases import StandIn, sglang_tree
from sgl_pool import published_context
from sgl_round import VERIFY, Case, NodeInputs, chain_links, verify_writes
from test_sglang_chain import sglang_linear

N_MAX, HEADS, MAX_LEN, C4_LAYER = 10, 8, 4096, 0


@pytest.fixture(scope="module")
def context(tmp_path_factory):
    with published_context(dsv4_dir(str(tmp_path_factory.mktemp("models"))), N_MAX):
        install_move_kv_cache()
        yield


class IndexerStandIn:
    """What SGLang's forward_c4_indexer reads of its C4Indexer: q_lora carries each row's node id,
    compute_q returns that node's query (fp8) and head weights (drawn by the test)."""
    use_fp4_indexer = False
    index_topk = 512

    def __init__(self, compressor, q: torch.Tensor, w: torch.Tensor):
        self.layer_id, self.compressor, self.q, self.w = C4_LAYER, compressor, q, w

    def compute_weights(self, x, skip_scale=False):
        return None

    def compute_q(self, q_lora, positions, weights, q_lora_quant=None):
        return self.q[q_lora], self.w[q_lora]


def backend_on(cls, pool, req_to_token, meta):
    be = object.__new__(cls)
    be.token_to_kv_pool, be.req_to_token, be._tree_ops, be.forward_metadata = pool, req_to_token, None, meta
    be.dsa_topk_backend, be.hisparse_coordinator, be.debug_use_external_c4_sparse_indices = \
        DSATopKBackend.TORCH, None, False
    return be


def run_indexer(fn, be, indexer, node_ids):
    fn(be, x=torch.zeros(node_ids.shape[0], 1), q_lora=node_ids, c4_indexer=indexer,
       forward_batch=type("FB", (), {"forward_mode": VERIFY})(), skip_compressor=True)
    return be.forward_metadata.core_attn_metadata.c4_sparse_page_indices.clone()


def valid_index_keys(case, gen):
    """Both pools' committed C4 indexer keys: valid FP8 records of random keys (the random fill's
    bytes hold NaN codes and scales), the same in both."""
    slots = torch.arange(case.tree_pool.dsv4_tree_scratch.start[4])
    data, scales = quantize_rows(torch.randn(slots.shape[0], 128, generator=gen), IndexKeyLayout(128))
    for pool in case.pools:
        keys = layer_buffers(pool, C4_LAYER).index_keys
        keys.flat()[keys.element_index(slots)] = torch.cat([data, scales], dim=1)


def path_of(parents, b, i):
    path = [i]
    while int(parents[b, path[-1]]) >= 0:
        path.append(int(parents[b, path[-1]]))
    return path[::-1]


def chain_indexer(case, rid, p, nodes, inputs, indexer):
    """SGLang's own forward_c4_indexer on SGLang's own metadata for a chain verify of `nodes`
    (global row ids) after that chain's writes on case.chain_pool -> its last row's indices."""
    L = len(nodes)
    rpi, seq = torch.tensor([rid], dtype=torch.int32), torch.tensor([p], dtype=torch.int32)
    idx = torch.tensor(nodes)
    out_loc, _ = verify_writes(case.chain_pool, case.req_to_token, case.mapping, rpi, seq, *chain_links(L),
                               inputs.rows(idx), case.comps, get_backend("torch"))
    sb = StandIn(case.req_to_token, case.mapping, L)
    core, idx_meta = sglang_linear(sb, rpi, seq, out_loc, L)
    be = backend_on(dsv4.DeepseekV4AttnBackend, case.chain_pool, case.req_to_token, dsv4.DSV4Metadata(core, idx_meta))
    return run_indexer(dsv4.DeepseekV4AttnBackend.forward_c4_indexer, be, indexer, idx)[L - 1]


CASES = [  # (lens, topk, steps, n): C4 blocks close at depth 1 (P = 4k + 2) or 2 (4k + 1)
    ([2102, 2301], 3, 3, 8), ([2053, 2558], 4, 2, 10), ([2305, 3070], 2, 4, 7), ([3001, 2082], 4, 3, 10)]


@pytest.mark.parametrize("lens,topk,steps,n", CASES)
def test_tree_rows_select_their_paths_entries(context, no_flashmla_schedule, lens, topk, steps, n):
    gen = torch.Generator().manual_seed(sum(lens) + n)
    case = Case(lens, gen, N_MAX, max_len=MAX_LEN)
    valid_index_keys(case, gen)
    bs = len(lens)
    rpi = torch.arange(1, bs + 1, dtype=torch.int32).flip(0)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    _, rn, rs = sglang_tree(bs, topk, steps, n, seq_lens, gen)
    inputs = NodeInputs.draw(bs * n, case.comps, gen)
    q = torch.randn(bs * n, HEADS, 128, generator=gen).to(torch.float8_e4m3fn)
    w = torch.rand(bs * n, HEADS, 1, generator=gen) + 0.1
    indexer = IndexerStandIn(next(c for c in case.comps if c.is_in_indexer), q, w)
    _, meta = verify_writes(case.tree_pool, case.req_to_token, case.mapping, rpi, seq_lens, rn, rs, inputs,
                            case.comps, get_backend("torch"))
    rows = torch.arange(bs * n)
    be = backend_on(TreeDeepseekV4AttnBackend, case.tree_pool, case.req_to_token, meta)
    ours = run_indexer(TreeDeepseekV4AttnBackend.forward_c4_indexer, be, indexer, rows)
    sglangs = run_indexer(dsv4.DeepseekV4AttnBackend.forward_c4_indexer, be, indexer, rows)  # page table only
    start = case.tree_pool.dsv4_tree_scratch.start[4]
    tree_lb, chain_lb = layer_buffers(case.tree_pool, C4_LAYER), layer_buffers(case.chain_pool, C4_LAYER)
    parents = parents_from_retrieve(rn, rs)
    seen = {"scratch_selected": 0, "sglang_differs": 0}
    for b in range(bs):
        rid, p = int(rpi[b]), lens[b]
        for i in range(n):
            t = b * n + i
            path = path_of(parents, b, i)
            assert (p + len(path)) // 4 > indexer.index_topk  # the selection depends on the scores
            want = chain_indexer(case, rid, p, [b * n + a for a in path], inputs, indexer)
            # the chain's branch entries sit at their homes; the tree row's at its own slots
            branch = meta.tree.c4_branch[t]
            homes = {int(case.req_to_token[rid, 4 * (p // 4 + j) + 3]) // 4: int(s)
                     for j, s in enumerate(branch.tolist()) if s >= 0}
            expect = torch.tensor([homes.get(int(s), int(s)) for s in want], dtype=ours.dtype)
            label = f"{lens=} {topk=} {steps=} {b=} {i=} {path=}"
            assert torch.equal(ours[t], expect), label
            sel = ours[t][ours[t] >= 0].to(torch.int64)
            chain_sel = want[want >= 0].to(torch.int64)
            assert sel.numel() == indexer.index_topk, label
            assert torch.equal(tree_lb.entries.read(sel), chain_lb.entries.read(chain_sel)), label
            assert torch.equal(tree_lb.index_keys.read(sel), chain_lb.index_keys.read(chain_sel)), label
            seen["scratch_selected"] += int((sel >= start).sum())
            seen["sglang_differs"] += not torch.equal(sglangs[t], ours[t])
    # non-vacuous: rows selected scratch entries, and the page table alone selects differently
    assert seen["scratch_selected"] and seen["sglang_differs"], seen


def test_a_chain_keeps_sglangs_indexer_output(context, no_flashmla_schedule):
    gen = torch.Generator().manual_seed(9)
    lens, n = [2301, 2094], 8
    case = Case(lens, gen, N_MAX, max_len=MAX_LEN)
    valid_index_keys(case, gen)
    rpi, seq_lens = torch.tensor([2, 1], dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)
    nxt, sib = chain_links(n)
    inputs = NodeInputs.draw(2 * n, case.comps, gen)
    q = torch.randn(2 * n, HEADS, 128, generator=gen).to(torch.float8_e4m3fn)
    w = torch.rand(2 * n, HEADS, 1, generator=gen) + 0.1
    indexer = IndexerStandIn(next(c for c in case.comps if c.is_in_indexer), q, w)
    out_loc, meta = verify_writes(case.tree_pool, case.req_to_token, case.mapping, rpi, seq_lens,
                                  nxt.expand(2, n), sib.expand(2, n), inputs, case.comps, get_backend("torch"))
    rows = torch.arange(2 * n)
    ours = run_indexer(TreeDeepseekV4AttnBackend.forward_c4_indexer,
                       backend_on(TreeDeepseekV4AttnBackend, case.tree_pool, case.req_to_token, meta), indexer, rows)
    core, idx_meta = sglang_linear(StandIn(case.req_to_token, case.mapping, n), rpi, seq_lens, out_loc, n)
    be = backend_on(dsv4.DeepseekV4AttnBackend, case.tree_pool, case.req_to_token, dsv4.DSV4Metadata(core, idx_meta))
    want = run_indexer(dsv4.DeepseekV4AttnBackend.forward_c4_indexer, be, indexer, rows)
    assert torch.equal(ours, want)
    assert bool((ours >= 0).sum(1).eq(512).all())


def test_unsupported_indexer_settings_are_refused_by_name(no_flashmla_schedule):
    from dsv4_tree.errors import ConfigError, StateError
    from dsv4_tree.sglang_plugin.metadata import tree_verify_metadata
    from sgl_cases import layout

    gen = torch.Generator().manual_seed(3)
    lens, n = [125], 8
    req_to_token, mapping = layout(lens, n, gen)
    sb = StandIn(req_to_token, mapping, n)
    out_loc = req_to_token[1, lens[0]:lens[0] + n].to(torch.int64)
    raw = dsv4.DSV4RawVerifyMetadata(req_pool_indices=torch.tensor([1], dtype=torch.int32),
                                     seq_lens=torch.tensor(lens, dtype=torch.int32), out_cache_loc=out_loc)
    meta = tree_verify_metadata(sb, raw, *chain_links(n))
    be = backend_on(TreeDeepseekV4AttnBackend, sb.token_to_kv_pool, req_to_token, meta)
    indexer = IndexerStandIn(None, None, None)
    batch = type("FB", (), {"forward_mode": VERIFY})()
    fp4 = IndexerStandIn(None, None, None)
    fp4.use_fp4_indexer = True
    with pytest.raises(ConfigError, match="FP4 indexer"):
        be.forward_c4_indexer(x=torch.zeros(n, 1), q_lora=torch.arange(n), c4_indexer=fp4, forward_batch=batch)
    be.hisparse_coordinator = object()
    with pytest.raises(ConfigError, match="hisparse_coordinator"):
        be.forward_c4_indexer(x=torch.zeros(n, 1), q_lora=torch.arange(n), c4_indexer=indexer, forward_batch=batch)
    be.hisparse_coordinator = None
    with pytest.raises(StateError, match="8 verify rows, got x with 7"):
        be.forward_c4_indexer(x=torch.zeros(n - 1, 1), q_lora=torch.arange(n), c4_indexer=indexer,
                              forward_batch=batch)
