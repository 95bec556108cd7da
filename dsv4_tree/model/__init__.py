"""Loading DeepSeek-V4 checkpoints and running verify rows through them."""
from .adapter import Model, load_model
from .release import write_release
from .tiny import tiny_checkpoint, tiny_config, trained_checkpoint, write_random_checkpoint

__all__ = ["Model", "load_model", "tiny_checkpoint", "tiny_config", "trained_checkpoint", "write_random_checkpoint",
           "write_release"]
