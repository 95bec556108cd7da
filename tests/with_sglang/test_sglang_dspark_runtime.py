"""Where SGLang 0.5.23 sizes a DSpark worker by N = gamma + 1, the DSpark tree keeps gamma (draft
block rows) and N (verify rows) apart: SGLang's own functions under the plug-in's hooks, with a
published DSpark tree spec (topk 4, gamma 5, N 8) and, for comparison, SGLang's DSpark chain."""
from types import SimpleNamespace

import pytest
from sglang.srt import runtime_context
from sglang.srt.layers.attention import deepseek_v4_backend as dsv4
from sglang.srt.mem_cache.allocation_sizing import get_alloc_len_per_decode
from sglang.srt.speculative.dspark_components.dspark_config import resolve_runtime_config
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

from dsv4_tree.errors import StateError
from dsv4_tree.sglang_plugin import dspark_worker, hooks
from dsv4_tree.sglang_plugin.dspark_runtime import (around_get_alloc_len_per_decode,
                                                    around_num_tokens_per_req_for_target_verify,
                                                    around_resolve_runtime_config, dspark_tree_spec)
from plugin_probe import dspark_dir

TREE = dict(speculative_algorithm="DSPARK", speculative_eagle_topk=4, speculative_dspark_block_size=5,
            speculative_num_draft_tokens=8, speculative_num_steps=1, max_speculative_num_draft_tokens=None)
CHAIN = dict(TREE, speculative_eagle_topk=1, speculative_dspark_block_size=None, speculative_num_draft_tokens=6)


def publish(monkeypatch, **spec):
    from sglang.srt.mem_cache import allocation_sizing

    monkeypatch.setattr(runtime_context, "get_spec", lambda: SimpleNamespace(**spec))
    monkeypatch.setattr(allocation_sizing, "get_spec", runtime_context.get_spec, raising=False)
    monkeypatch.setattr(allocation_sizing, "get_alloc_page_size", lambda: 256)  # DeepSeek-V4's page


@pytest.fixture(scope="module")
def draft_config(tmp_path_factory):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(dspark_dir(str(tmp_path_factory.mktemp("models"))))


def test_the_runtime_config_keeps_gamma_and_n_apart(monkeypatch, draft_config):
    kw = dict(draft_hf_config=draft_config, speculative_num_draft_tokens=8, target_vocab_size=1000)
    stock = resolve_runtime_config(**kw)  # SGLang alone: gamma = N - 1, a 7-row block for a gamma-5 drafter
    assert (stock.gamma, stock.verify_num_draft_tokens) == (7, 8)
    publish(monkeypatch, **TREE)
    tree = around_resolve_runtime_config(resolve_runtime_config, **kw)
    assert (tree.gamma, tree.verify_num_draft_tokens, tree.mask_token_id) == (5, 8, stock.mask_token_id)
    publish(monkeypatch, **CHAIN)  # topk 1: SGLang's function alone
    assert around_resolve_runtime_config(resolve_runtime_config, **dict(kw, speculative_num_draft_tokens=6)) == \
        resolve_runtime_config(**dict(kw, speculative_num_draft_tokens=6))


def test_graph_buckets_and_kv_allocation(monkeypatch):
    dspark = SpeculativeAlgorithm.from_string("DSPARK")
    original = SpeculativeAlgorithm.get_num_tokens_per_req_for_target_verify
    publish(monkeypatch, **TREE)
    assert around_num_tokens_per_req_for_target_verify(original, dspark, 8, True) == 5  # the draft block
    assert around_num_tokens_per_req_for_target_verify(original, dspark, 8, False) == 8  # the target verify
    assert original(dspark, 8, True) == 7  # SGLang's own rule would size the draft runner for gamma 7
    assert around_get_alloc_len_per_decode(get_alloc_len_per_decode) == 8  # the N-slot window, no branch regions
    assert get_alloc_len_per_decode() > 256  # SGLang's topk > 1 rule: a page-aligned region per branch
    publish(monkeypatch, **CHAIN)
    assert around_num_tokens_per_req_for_target_verify(original, dspark, 6, True) == original(dspark, 6, True) == 5
    assert around_get_alloc_len_per_decode(get_alloc_len_per_decode) == get_alloc_len_per_decode()
    publish(monkeypatch, **dict(TREE, speculative_dspark_block_size=None))
    with pytest.raises(StateError, match="no speculative_dspark_block_size"):
        dspark_tree_spec()


def test_the_draft_runner_keeps_sglangs_backend(monkeypatch):
    """The DSpark draft runner's backend is SGLang's own, built as for SGLang's DSpark chain of the
    tree's gamma (topk 1, N = gamma + 1); the target gets the tree backend."""
    publish(monkeypatch, **TREE)
    monkeypatch.setattr(dsv4, "get_spec", runtime_context.get_spec)
    seen = lambda runner, **kw: (dsv4.get_spec().speculative_eagle_topk,  # noqa: E731
                                 dsv4.get_spec().speculative_num_draft_tokens, kw)
    draft = SimpleNamespace(is_draft_worker=True, spec_algorithm=SpeculativeAlgorithm.from_string("DSPARK"))
    assert hooks.around_create_deepseek_v4_attn_backend(seen, draft, skip_prefill=True) == (1, 6, {"skip_prefill": True})
    ms = lambda runner, topk, speculative_num_steps: (topk, dsv4.get_spec().speculative_num_draft_tokens)  # noqa: E731
    assert hooks.around_create_deepseek_v4_multistep_backend(ms, draft, 4, 1) == (1, 6)
    assert dsv4.get_spec().speculative_eagle_topk == 4  # the view ends with the call
    from dsv4_tree.sglang_plugin import backend
    from sglang.srt.layers.attention import deepseek_v4_trtllm_backend as trt

    monkeypatch.setattr(trt, "is_dsv4_trtllm_attn_enabled", lambda: False)
    monkeypatch.setattr(trt, "is_dsv4_mega_attn_enabled", lambda: False)
    monkeypatch.setattr(backend.TreeDeepseekV4AttnBackend, "__init__", lambda self, runner, **kw: None)
    target = SimpleNamespace(is_draft_worker=False, spec_algorithm=draft.spec_algorithm)
    assert isinstance(hooks.around_create_deepseek_v4_attn_backend(seen, target), backend.TreeDeepseekV4AttnBackend)


def test_the_worker_gets_the_tree_step_only_for_a_tree_on_the_draft_stage(monkeypatch):
    built = []
    monkeypatch.setattr("dsv4_tree.sglang_plugin.dspark_step.DSparkTreeStep",
                        lambda worker, tree: built.append(tree) or "step")
    init = lambda worker, *a, **k: worker.__dict__.update(_hosts_draft=k["hosts"])  # noqa: E731
    publish(monkeypatch, **TREE)
    stage = SimpleNamespace()
    dspark_worker.around_dspark_worker_init(init, stage, hosts=False)  # a PP stage without the draft
    assert dspark_worker.STEP not in stage.__dict__
    last = SimpleNamespace()
    dspark_worker.around_dspark_worker_init(init, last, hosts=True)
    assert last.__dict__[dspark_worker.STEP] == "step" and built[0].gamma == 5 and built[0].num_draft_tokens == 8
    publish(monkeypatch, **CHAIN)
    chain = SimpleNamespace()
    dspark_worker.around_dspark_worker_init(init, chain, hosts=True)
    assert dspark_worker.STEP not in chain.__dict__
    original = lambda worker, batch, on_publish, grammar_barrier=None, coordination_plan=None: "sglang"  # noqa: E731
    assert dspark_worker.around_dspark_forward_decode(original, chain, None, None) == "sglang"
    last.__dict__[dspark_worker.STEP] = SimpleNamespace(run=lambda *a: "tree")
    assert dspark_worker.around_dspark_forward_decode(original, last, None, None) == "tree"
