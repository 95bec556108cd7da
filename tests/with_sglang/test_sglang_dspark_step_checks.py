"""What the DSpark tree step refuses when SGLang's DSpark worker is built (ConfigError naming the
part), and at run time (StateError), on a worker as the step reads it."""
from types import SimpleNamespace

import pytest
import torch

from dsv4_tree.errors import ConfigError, StateError
from dsv4_tree.sglang_plugin.dspark_runtime import DSparkTreeSpec
from dsv4_tree.sglang_plugin.dspark_step import DSparkTreeStep, check_worker

TREE = DSparkTreeSpec(topk=4, gamma=5, num_draft_tokens=8)


def worker(**kw):
    runner = SimpleNamespace(ngram_embedding_manager=SimpleNamespace(enabled=False), watermark_state=None)
    base = dict(gamma=5, verify_num_draft_tokens=8, sample_from_anchor=True, _draft_is_moe=True,
                _verify_epilogue=None, _sampling_accept_graph=None, model_runner=runner,
                draft_model=SimpleNamespace(markov_head=None))
    base.update(kw)
    return SimpleNamespace(**base)


@pytest.mark.parametrize("change, named", [
    ({"gamma": 7}, "resolved gamma=7, verify width 8; the tree needs gamma=5, 8"),
    ({"verify_num_draft_tokens": 6}, "verify width 6"),
    ({"sample_from_anchor": False}, "sample_from_anchor=false"),
    ({"_draft_is_moe": False}, "not a DeepSeek-V4 DSpark module"),
    ({"_verify_epilogue": object()}, "in-graph verify epilogue"),
    ({"_sampling_accept_graph": object()}, "sampling-accept graph"),
    ({"model_runner": SimpleNamespace(ngram_embedding_manager=SimpleNamespace(enabled=True), watermark_state=None)},
     "engram"),
    ({"model_runner": SimpleNamespace(ngram_embedding_manager=None, watermark_state=object())}, "watermarking"),
])
def test_the_tree_step_refuses_a_worker_it_cannot_serve(change, named):
    check_worker(worker(), TREE)  # SGLang's DSpark worker as the tree resolves it
    with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace(")", r"\)")):
        DSparkTreeStep(worker(**change), TREE)


def test_the_tree_step_needs_sglangs_v4_markov_head():
    with pytest.raises(ConfigError, match="DSparkV4MarkovHead.*got NoneType"):
        DSparkTreeStep(worker(), TREE)


def test_the_tree_step_refuses_grammar_batches_and_dp_plans():
    step = object.__new__(DSparkTreeStep)
    step.worker, step.tree = worker(device="cpu", _need_mamba_verify_commit=False), TREE
    decode = SimpleNamespace(is_idle=lambda: False)
    batch = SimpleNamespace(spec_info=SimpleNamespace(), forward_mode=decode, has_grammar=True,
                            seq_lens=torch.tensor([5]))
    with pytest.raises(StateError, match="grammar-guided"):
        step.run(batch, None)
    with pytest.raises(StateError, match="DP prefill-coordination plan"):
        step.run(batch, None, coordination_plan=object())
