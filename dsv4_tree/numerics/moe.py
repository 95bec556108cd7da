"""DeepSeek-V4's MoE block (router, routed experts, shared expert) over packed rows, in fewer ops
than transformers' module call, and the experts implementation packed rows run.

`DeepseekV4SparseMoeBlock.forward` goes through its router module, then the experts
implementation transformers dispatches to, then the shared-expert module. For the grouped
implementation (`"grouped_mm"`, what `rows_experts` picks everywhere except fp32 on
cuda) transformers' function sorts the (row, expert) pairs by expert, runs two grouped GEMMs and
puts the pairs back in row order with an inverse permutation built by a scatter: about 30 tensor
ops and several Python helper layers per call, made on every layer of every verify and draft
step. `moe_rows` computes the same numbers with the same kernels in the same order (the same
router formulas, the same `torch.sort` permutation, transformers' own `_grouped_mm` dispatcher
and `_apply_gate`, the same weighted sum over the top-k), so the output is bitwise the
module's (tests/test_moe.py); the inverse permutation is one `index_copy_`.

Any other experts implementation (`batched_mm`, a caller's choice, transformers' kept FP8
experts with their own kernels) runs the module's experts forward, with the implementation
`chosen_experts` names set on its config for the call (`experts_implementation`)."""
from __future__ import annotations

import contextlib

import torch
from torch.nn import functional as F
from transformers.integrations.moe import _grouped_mm
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Experts


def route(gate, flat: torch.Tensor, ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' DeepseekV4TopKRouter / DeepseekV4HashRouter: flat [N, hidden], ids [N]
    (hash routing) -> (weights [N, k] scaled, expert indices [N, k] int64)."""
    scores = gate.score_fn(F.linear(flat, gate.weight))
    if hasattr(gate, "tid2eid"):
        indices = gate.tid2eid[ids.reshape(-1)].long()
    else:
        indices = torch.topk(scores + gate.e_score_correction_bias, gate.top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, indices)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * gate.routed_scaling_factor, indices


def rows_experts(experts) -> str:
    """The routed-experts implementation for packed rows on `experts`' device and dtype.
    "grouped_mm" sorts rows by expert and runs one grouped GEMM with offsets on the device: no
    host synchronisation and no data-dependent shapes, unlike HF's default eager loop over hit
    experts (`nonzero()`). For fp32 weights on cuda, torch's grouped GEMM reads the offsets on
    the host (a sync per MoE layer; CUDA-graph capture fails), so there "batched_mm" is used:
    each row gathers its experts' weights (sync-free; its scratch grows with rows x top-k x
    expert size, fine for fp32, a debugging dtype). Every other case, transformers' kept FP8
    experts (their own grouped kernels) and fp16 included, stays on "grouped_mm"
    (design_notes/device-path.md)."""
    w = experts.gate_up_proj
    return "batched_mm" if w.device.type == "cuda" and w.dtype == torch.float32 else "grouped_mm"


# implementations replaced with rows_experts' choice: transformers' defaults (it picks
# "grouped_mm" where torch can dispatch it, else "eager"); anything else was chosen by the
# caller (batched_mm, a registered kernel) and stays
REPLACED_EXPERTS = (None, "eager", "grouped_mm")


def chosen_experts(experts) -> str:
    """The implementation packed rows run on `experts`: the caller's, when its config holds one
    outside REPLACED_EXPERTS, else rows_experts'."""
    own = experts.config._experts_implementation
    return own if own not in REPLACED_EXPERTS else rows_experts(experts)


@contextlib.contextmanager
def experts_implementation(config, name: str):
    """Run the routed experts reading `config` with transformers' `name` implementation inside
    the block, restoring it after, unless the config holds a caller's choice (not in
    REPLACED_EXPERTS)."""
    before = config._experts_implementation
    if before not in REPLACED_EXPERTS:
        yield
        return
    config._experts_implementation = name
    try:
        yield
    finally:
        config._experts_implementation = before


def grouped_applies(experts) -> bool:
    """Whether `experts` runs transformers' grouped implementation on plain expert weights
    (the case `grouped_experts` reproduces). Not where a tensor / expert plan hooked the module
    (`_is_hooked`): its weights are shards, and the forward transformers installed runs the local
    shards and the sum across ranks."""
    return (isinstance(experts, DeepseekV4Experts) and chosen_experts(experts) == "grouped_mm"
            and experts.has_gate and not experts.has_bias and not experts.is_transposed
            and not experts.has_post_expert_norm and not experts._is_expert_parallel
            and not getattr(experts, "_is_hooked", False))


def grouped_experts(experts, flat: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """transformers' grouped_mm experts forward: flat [N, hidden], indices / weights [N, k] -> [N, hidden]."""
    n, k = indices.shape
    expert_sorted, perm = torch.sort(indices.reshape(-1))
    if flat.device.type in ("cpu", "mps"):  # histc takes floats there, ints on cuda (as transformers)
        counted = expert_sorted.float()
    else:
        counted = expert_sorted.int()
    per_expert = torch.histc(counted, bins=experts.num_experts, min=0, max=experts.num_experts - 1)
    offsets = torch.cumsum(per_expert, dim=0, dtype=torch.int32)
    hidden = _grouped_mm(flat[perm // k], experts.gate_up_proj.transpose(-2, -1), offs=offsets)
    out = _grouped_mm(experts._apply_gate(hidden), experts.down_proj.transpose(-2, -1), offs=offsets)
    out = out * weights.reshape(-1)[perm].unsqueeze(-1)
    unsorted = torch.empty_like(out).index_copy_(0, perm, out)
    return unsorted.view(n, k, -1).sum(dim=1).to(flat.dtype)


def moe_rows(mlp, x: torch.Tensor, ids: torch.Tensor | None) -> torch.Tensor:
    """DeepseekV4SparseMoeBlock(x, input_ids=ids): x [B, S, hidden], ids [B, S] -> [B, S, hidden]."""
    flat = x.reshape(-1, x.shape[-1])
    weights, indices = route(mlp.gate, flat, ids)
    experts = mlp.experts
    if grouped_applies(experts):
        routed = grouped_experts(experts, flat, indices, weights)
    else:
        with experts_implementation(experts.config, chosen_experts(experts)), _collectives_dispatch():
            routed = experts(flat, indices, weights)
    return routed.view(x.shape) + mlp.shared_experts(x)


def _collectives_dispatch():
    """On several ranks, transformers' expert parallelism exchanges tokens with torch's
    `all_to_all_single_autograd`, which torch 2.11 registers under autograd dispatch keys only:
    inference mode skips those, leaving no CPU kernel (NotImplementedError). Outside inference
    mode and without grad it dispatches there on every torch; one rank: nothing changes."""
    import contextlib

    import torch.distributed as dist

    if not (torch.is_inference_mode_enabled() and dist.is_available() and dist.is_initialized()):
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(torch.inference_mode(False))
    stack.enter_context(torch.no_grad())
    return stack
