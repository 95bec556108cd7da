"""Each closing node's stored entry (C4 / C128 K=V entry, C4 indexer key) is the compression of its
own root-to-node path, by an independent oracle: the block's rows assembled position by position
(committed rows from SGLang's state ring as it was before the verify, the path's own rows from the
verify input), SGLang's row layout split by hand, dsv4-tree's clear per-entry reference
(ref_pool_entries), the Hadamard rotation as a +-1 matrix, on a real DeepSeekV4TokenToKVPool."""
import pytest
import torch

from dsv4_tree.attention.backend import get_backend
from dsv4_tree.numerics.rope import apply_rope, rope_pairs
from dsv4_tree.reference.ops import ref_pool_entries
from dsv4_tree.serving.records import IndexKeyLayout, RecordLayout, dequantize_rows
from dsv4_tree.sglang_plugin import install_move_kv_cache
from dsv4_tree.sglang_plugin.scratch import layer_buffers
from dsv4_tree.sglang_plugin.tables import parents_from_retrieve
from plugin_probe import dsv4_dir
from sgl_cases import sglang_tree
from sgl_pool import published_context, snapshot
from sgl_round import Case, NodeInputs, verify_writes


@pytest.fixture(scope="module")
def context(tmp_path_factory):
    with published_context(dsv4_dir(str(tmp_path_factory.mktemp("models"))), 10):
        install_move_kv_cache()
        yield


class Norm(torch.nn.Module):
    def __init__(self, weight, eps):
        super().__init__()
        self.weight, self.variance_epsilon = weight, eps

    def forward(self, x):
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon) * self.weight


def hadamard_matrix(d: int) -> torch.Tensor:
    sign = [[(-1) ** bin(j & k).count("1") for k in range(d)] for j in range(d)]
    return torch.tensor(sign, dtype=torch.float32) * d ** -0.5


def path_of(parents, b, i):
    path = [i]
    while int(parents[b, path[-1]]) >= 0:
        path.append(int(parents[b, path[-1]]))
    return path[::-1]


def ring_row(case, c, rid, q, before):
    """SGLang's committed state row of position q, from the pool's layout rules, in `before`."""
    if c.ratio == 4:
        swa = int(case.mapping[int(case.req_to_token[rid, q])])
        row = (swa // 256) * 16 + swa % 16
    else:
        row = rid * 256 + q % 256
    name = f"{'index_state' if c.is_in_indexer else 'state'}.{c.layer_id}"
    return before[name][row]


@pytest.mark.parametrize("ops", ["torch", "triton"])
def test_each_closing_nodes_entry_compresses_its_own_path(context, no_flashmla_schedule, ops):
    gen = torch.Generator().manual_seed(5)
    lens, topk, steps, n = [126, 381], 3, 3, 8  # C4 + C128 blocks close at depth 1 (128) and 2 (384)
    case = Case(lens, gen, n)
    pool = case.tree_pool
    rpi = torch.tensor([1, 2], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    _, rn, rs = sglang_tree(2, topk, steps, n, seq_lens, gen)
    inputs = NodeInputs.draw(2 * n, case.comps, gen)
    before = snapshot(pool)
    _, meta = verify_writes(pool, case.req_to_token, case.mapping, rpi, seq_lens, rn, rs, inputs, case.comps,
                            get_backend(ops))
    parents = parents_from_retrieve(rn, rs)
    checked = {4: 0, 128: 0, "scratch": 0}
    for k, c in enumerate(case.comps):
        m, d = c.ratio, c.head_dim
        width = 2 * m if m == 4 else m
        bias = c.ape.reshape(-1, d)
        lb = layer_buffers(pool, c.layer_id)
        target = lb.index_keys if c.is_in_indexer else lb.entries
        rec = IndexKeyLayout(128) if c.is_in_indexer else RecordLayout(512, 64)
        out = meta.tree.c4_out_loc if m == 4 else meta.tree.c128_out_loc
        for b, (rid, P) in enumerate(zip(rpi.tolist(), lens)):
            for i in range(n):
                path = path_of(parents, b, i)
                end = P + len(path)  # the row's causal length
                if end % m:
                    continue
                kv, gate = [], []
                for w in range(width):
                    q = end - width + w
                    if q < 0:
                        kv.append(torch.zeros(d)), gate.append(torch.full((d,), float("-inf")))
                        continue
                    row = ring_row(case, c, rid, q, before) if q < P else inputs.kv_score[k][b * n + path[q - P]]
                    if m == 4:  # [kv overlap | kv | score overlap | score]: previous block, then own half
                        half = 0 if w < m else 1
                        kv.append(row[half * d:(half + 1) * d]), gate.append(row[(2 + half) * d:(3 + half) * d] + bias[w])
                    else:
                        kv.append(row[:d]), gate.append(row[d:2 * d] + bias[w])
                f = c.freqs_cis[end - m]
                C, S = rope_pairs(f.real.view(1, 1, -1), f.imag.view(1, 1, -1))
                want = ref_pool_entries(torch.stack(kv)[None], torch.stack(gate)[None], Norm(c.norm.weight, 1e-6),
                                        C, S, apply_rope)
                if c.is_in_indexer:
                    want = want @ hadamard_matrix(d)
                slot = int(out[b * n + i])
                got_bytes = target.read(torch.tensor([slot]))
                got = dequantize_rows(got_bytes[:, :rec.data_bytes], got_bytes[:, rec.data_bytes:], rec, torch.float32)
                # one e4m3 step (3 mantissa bits: 1/8 relative) where the two sides round across a code
                # boundary, plus the subnormal spacing of the row's scale
                tol = want.abs() / 8 + want.abs().max() / 448 * 2 ** -8
                label = f"{ops=} {m=} indexer={c.is_in_indexer} {b=} {i=} {path=} {slot=}"
                assert bool(((got - want).abs() <= tol).all()), label
                checked[m] += 1
                checked["scratch"] += slot >= pool.dsv4_tree_scratch.start[m]
    assert checked[4] and checked[128] and checked["scratch"], checked
