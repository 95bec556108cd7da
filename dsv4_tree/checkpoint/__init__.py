"""Checkpoints: reading directories (dense Hugging Face layout and DeepSeek's release format,
FP8 / FP4, sharded), writing the release format, the MTP block's weights, the tiny models."""
from .release import write_release
from .tiny import tiny_checkpoint, tiny_config, trained_checkpoint, write_random_checkpoint

__all__ = ["tiny_checkpoint", "tiny_config", "trained_checkpoint", "write_random_checkpoint", "write_release"]
