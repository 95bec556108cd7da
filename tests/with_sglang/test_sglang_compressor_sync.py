"""The tree compressor reads no device value on the host on its per-layer path (SGLang calls it
once per compressor per layer, inside the captured verify graph): fixed shape over every row,
the ancestor table from the verify's tables (`TreeVerifyTables.ancestors`). Checked with
`dsv4_tree.diagnostics.forbid_host_sync`, which applies its rule to CPU tensors too (a scalar
read, `nonzero`, boolean-mask indexing raise), around every compressor call of a tree verify on
a real DeepSeekV4TokenToKVPool; the entries written equal those of the unguarded run."""
import contextlib
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.layers.attention import deepseek_v4_backend as dsv4

from dsv4_tree.attention.backend import get_backend
from dsv4_tree.diagnostics import forbid_host_sync
from dsv4_tree.errors import StateError
from dsv4_tree.sglang_plugin.backend import TreeDeepseekV4AttnBackend
from dsv4_tree.sglang_plugin.metadata import tree_verify_metadata
from plugin_probe import dsv4_dir
from sgl_cases import StandIn, sglang_tree
from sgl_graph import captured
from sgl_pool import published_context, snapshot
from sgl_round import VERIFY, Case, NodeInputs, differing


@pytest.fixture(scope="module")
def context(tmp_path_factory):
    with published_context(dsv4_dir(str(tmp_path_factory.mktemp("models"))), 10):
        yield


def compressor_pass(case, pool, rpi, seq_lens, rn, rs, inputs, guard):
    bs, n = rn.shape
    out_loc = torch.cat([case.req_to_token[r, p:p + n] for r, p in zip(rpi.tolist(), seq_lens.tolist())])
    sb = StandIn(case.req_to_token, case.mapping, n)
    sb.token_to_kv_pool = pool
    raw = dsv4.DSV4RawVerifyMetadata(req_pool_indices=rpi, seq_lens=seq_lens, out_cache_loc=out_loc.to(torch.int64))
    backend = object.__new__(TreeDeepseekV4AttnBackend)
    backend.token_to_kv_pool, backend.req_to_token, backend._tree_ops = pool, case.req_to_token, get_backend("torch")
    backend.forward_metadata = tree_verify_metadata(sb, raw, rn, rs)
    batch = SimpleNamespace(forward_mode=VERIFY)
    for c, kv in zip(case.comps, inputs.kv_score):
        run = backend.forward_indexer_compressor if c.is_in_indexer else backend.forward_core_compressor
        with guard():
            run(kv, batch, c.layer_id, c)
    return backend.forward_metadata.tree


def test_compressor_calls_make_no_host_read(context, no_flashmla_schedule):
    gen = torch.Generator().manual_seed(61)
    lens, n = [125, 381], 8  # C4 and C128 blocks close inside both windows
    case = Case(lens, gen, n)
    rpi, seq_lens = torch.tensor([2, 1], dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)
    _, rn, rs = sglang_tree(2, 3, 3, n, seq_lens, gen)
    inputs = NodeInputs.draw(2 * n, case.comps, gen)
    tables = compressor_pass(case, case.tree_pool, rpi, seq_lens, rn, rs, inputs, captured)
    lens = tables.seq_lens_casual
    assert bool((lens % 4 == 0).any()) and bool((lens % 128 == 0).any())  # both ratios wrote entries
    compressor_pass(case, case.chain_pool, rpi, seq_lens, rn, rs, inputs, contextlib.nullcontext)
    same = {k: torch.zeros(v.numel(), dtype=torch.bool) for k, v in snapshot(case.tree_pool).items()}
    assert differing(snapshot(case.tree_pool), snapshot(case.chain_pool), same) == {}


def test_the_guard_sees_a_host_read_on_cpu():
    with pytest.raises(StateError, match="host synchronisation"):
        with forbid_host_sync():
            (torch.arange(4) % 4 == 0).nonzero()
