"""Every transformers internal this package relies on, imported in one place.

tests/test_transformers_contract.py checks these names and fields; if a transformers release
moves them, that test fails loudly instead of verify silently computing something else."""
from __future__ import annotations

from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
    DeepseekV4Attention,
    DeepseekV4CSACompressor,
    DeepseekV4HCACompressor,
    DeepseekV4Indexer,
    apply_rotary_pos_emb,
)

REQUIRED_TRANSFORMERS = "5.23.0"

__all__ = [
    "DeepseekV4Attention", "DeepseekV4CSACompressor", "DeepseekV4Config", "DeepseekV4ForCausalLM",
    "DeepseekV4HCACompressor", "DeepseekV4Indexer", "REQUIRED_TRANSFORMERS", "apply_rotary_pos_emb",
]
