"""A plain Hugging Face forward over a whole sequence, no cache: what the per-path oracle
(reference/per_path.py) and the synthetic planted drafter ask of the model."""
from __future__ import annotations

import torch


def hf_of(model):
    """The DeepseekV4ForCausalLM of a loaded `Model`, or the module itself."""
    return getattr(model, "hf", model)


@torch.no_grad()
def sequence_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """HF forward (no cache) over ids [L]; logits of every position. [L, vocab]"""
    hf = hf_of(model)
    ids = torch.as_tensor(ids, dtype=torch.int64).to(hf.lm_head.weight.device).unsqueeze(0)
    return hf(input_ids=ids, use_cache=False).logits[0]
