"""numerics/moe.py against transformers' DeepseekV4SparseMoeBlock: bitwise the module's output for
its grouped experts implementation, in fewer ops; every other implementation runs the module's
own experts forward."""
import pytest
import torch

from dsv4_tree.diagnostics import OpCounter
from dsv4_tree.numerics.moe import grouped_applies, moe_rows
from dsv4_tree.checkpoint.tiny import random_model, tiny_config


def block(layer: int, experts: int = 4, topk: int = 2, impl: str = "grouped_mm"):
    hf = random_model(tiny_config(n_routed_experts=experts, num_experts_per_tok=topk))
    hf.set_experts_implementation(impl)
    return hf, hf.model.layers[layer].mlp


@pytest.mark.parametrize("layer", [0, 2])  # hash routing, top-k routing
@pytest.mark.parametrize("rows", [1, 8, 37])
@pytest.mark.parametrize("experts,topk", [(4, 2), (8, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_rows_is_the_module_bitwise(layer, rows, experts, topk, dtype):
    hf, mlp = block(layer, experts, topk)
    hf.to(dtype)
    assert mlp.is_hash == (layer == 0) and grouped_applies(mlp.experts)
    torch.manual_seed(rows)
    x = torch.randn(1, rows, hf.config.hidden_size).to(dtype)
    ids = torch.randint(0, hf.config.vocab_size, (1, rows))
    with torch.no_grad():
        want = mlp(x, input_ids=ids)
        got = moe_rows(mlp, x, ids)
    assert got.shape == want.shape and torch.equal(got, want)


def test_moe_rows_takes_fewer_ops_than_the_module():
    hf, mlp = block(2)
    x = torch.randn(1, 8, hf.config.hidden_size)
    with torch.no_grad(), OpCounter() as theirs:
        mlp(x)
    with torch.no_grad(), OpCounter() as ours:
        moe_rows(mlp, x, None)
    assert ours.total < theirs.total, (ours.total, theirs.total)


def test_other_experts_implementations_run_the_modules_forward(monkeypatch):
    """batched_mm (fp32 on cuda) or any caller's choice: the module's experts forward runs."""
    hf, mlp = block(2, impl="batched_mm")
    assert not grouped_applies(mlp.experts)
    calls = []
    forward = type(mlp.experts).forward
    monkeypatch.setattr(type(mlp.experts), "forward", lambda self, *a: calls.append(1) or forward(self, *a))
    x = torch.randn(1, 5, hf.config.hidden_size)
    with torch.no_grad():
        want = mlp(x)
        got = moe_rows(mlp, x, None)
    assert len(calls) == 2  # once in the module call, once in moe_rows
    assert torch.equal(got, want)
