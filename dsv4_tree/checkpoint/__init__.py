"""Checkpoints: reading directories (dense Hugging Face layout and DeepSeek's release format,
FP8 / FP4, sharded), writing the release format, the MTP block's and DSpark's weights, the tiny models.
The names load on first access (PEP 562): they need the `hf` extra (transformers 5.23.0)."""
from ..lazy import lazy_attributes

_LAZY = {
    "write_release": ".release", "tiny_checkpoint": ".tiny", "tiny_config": ".tiny", "trained_checkpoint": ".tiny",
    "write_random_checkpoint": ".tiny", "load_dspark": ".dspark_names", "write_dspark": ".dspark_names",
    "add_dspark_to_checkpoint": ".dspark_names",
}

__all__ = ["add_dspark_to_checkpoint", "load_dspark", "tiny_checkpoint", "tiny_config", "trained_checkpoint",
           "write_dspark", "write_random_checkpoint", "write_release"]

__getattr__, __dir__ = lazy_attributes(__name__, globals(), _LAZY)
