"""Pools the tree backend must not grow: SGLang's HiSparse C4 pool caches its buffers' addresses
(`data_ptrs`) at construction, so growing them for the scratch pages (which replaces the tensors)
would leave HiSparse on the old memory. Refused before any buffer is replaced, by the backend's
pool check and by the grower itself, on a real `DeepSeekV4TokenToKVPool(enable_hisparse=True)`."""
import pytest
import torch

from dsv4_tree.errors import ConfigError
from dsv4_tree.sglang_plugin.backend import TreeDeepseekV4AttnBackend
from dsv4_tree.sglang_plugin.scratch import ensure_scratch
from plugin_probe import dsv4_dir
from sgl_cases import layout
from sgl_pool import all_buffers, make_pool, published_context


@pytest.fixture(scope="module")
def context(tmp_path_factory):
    with published_context(dsv4_dir(str(tmp_path_factory.mktemp("models"))), 8):
        yield


class _Spec:
    speculative_eagle_topk, speculative_num_draft_tokens = 4, 8


def hisparse_pool():
    req_to_token, mapping = layout([40], 8, torch.Generator().manual_seed(1), max_len=1024)
    pool = make_pool(req_to_token.shape[0] * 4 + 1, req_to_token.shape[0], mapping, enable_hisparse=True)
    assert type(pool.kv_pools[4]).__name__ == "HiSparseC4DevicePool" and pool.kv_pools[4].data_ptrs is not None
    return pool


def test_hisparse_pool_is_refused_before_growing(context):
    pool = hisparse_pool()
    before = all_buffers(pool)
    with pytest.raises(ConfigError, match="HiSparseC4DevicePool caches its buffers' addresses"):
        ensure_scratch(pool, 8)
    after = all_buffers(pool)
    assert all(after[k] is before[k] for k in before)  # no buffer tensor replaced
    assert getattr(pool, "dsv4_tree_scratch", None) is None


def test_tree_backend_refuses_hisparse_before_growing(context):
    pool = hisparse_pool()
    before = all_buffers(pool)
    backend = object.__new__(TreeDeepseekV4AttnBackend)
    backend.token_to_kv_pool, backend.low_ratios = pool, ()
    with pytest.raises(ConfigError, match="--enable-hisparse"):
        backend._tree_init(_Spec)
    assert all(all_buffers(pool)[k] is before[k] for k in before)
    backend.hisparse_coordinator = object()  # SGLang's backend keeps model_runner.hisparse_coordinator
    with pytest.raises(ConfigError, match="hisparse_coordinator"):
        backend._tree_init(_Spec)
    assert all(all_buffers(pool)[k] is before[k] for k in before)


class _Spec16:
    speculative_eagle_topk, speculative_num_draft_tokens = 4, 16


def test_tree_backend_refuses_a_c4_ring_narrower_than_the_window(tmp_path, monkeypatch):
    """A window of 16 on a pool sized without the plug-in's ring hook (SGLang's C4 ring of 16 rows,
    10 draft tokens at most): refused by the backend's pool check before anything is grown; the
    same pool sized through the hook (32 rows) is accepted and grown."""
    from functools import partial

    from sglang.srt.mem_cache import deepseek_v4_memory_pool as mp

    from dsv4_tree.sglang_plugin.ring import around_resolve_compress_state_ring_size

    req_to_token, mapping = layout([40], 16, torch.Generator().manual_seed(1), max_len=1024)
    with published_context(dsv4_dir(str(tmp_path)), 16, topk=4):
        pool = make_pool(req_to_token.shape[0] * 4 + 1, req_to_token.shape[0], mapping)
        before = all_buffers(pool)
        backend = object.__new__(TreeDeepseekV4AttnBackend)
        backend.token_to_kv_pool, backend.low_ratios = pool, ()
        with pytest.raises(ConfigError, match="C4 state ring of 16 rows serves at most 10 draft tokens, "
                                              "--speculative-num-draft-tokens is 16"):
            backend._tree_init(_Spec16)
        assert all(all_buffers(pool)[k] is before[k] for k in before)
        assert getattr(pool, "dsv4_tree_scratch", None) is None
        monkeypatch.setattr(mp, "resolve_compress_state_ring_size",
                            partial(around_resolve_compress_state_ring_size, mp.resolve_compress_state_ring_size))
        pool = make_pool(req_to_token.shape[0] * 4 + 1, req_to_token.shape[0], mapping)
        assert {sp.ring_size for sp in pool.compress_state_pools if sp is not None and sp.ratio == 4} == {32}
        backend.token_to_kv_pool = pool
        backend._tree_init(_Spec16)
        assert pool.dsv4_tree_scratch.per_request == 16
