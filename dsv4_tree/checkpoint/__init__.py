"""Checkpoints: reading directories (dense Hugging Face layout and DeepSeek's release format,
FP8 / FP4, sharded), writing the release format, the MTP block's weights, the tiny models.
The names load on first access (PEP 562): they need the `hf` extra (transformers 5.23.0)."""
from ..lazy import lazy_attributes

_LAZY = {
    "write_release": ".release", "tiny_checkpoint": ".tiny", "tiny_config": ".tiny", "trained_checkpoint": ".tiny",
    "write_random_checkpoint": ".tiny",
}

__all__ = ["tiny_checkpoint", "tiny_config", "trained_checkpoint", "write_random_checkpoint", "write_release"]

__getattr__, __dir__ = lazy_attributes(__name__, globals(), _LAZY)
