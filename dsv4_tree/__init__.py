"""dsv4-tree: tree speculative verify for DeepSeek-V4 attention, equal to per-path runs."""
from . import reference, serving, tree
from .config import SpecConfig
from .engine import Engine, Request, VerifyOutput
from .errors import CheckpointError, ConfigError, Dsv4TreeError, InputError, StateError, TreeError
from .hooks import validate_spec
from .checkpoint import tiny_checkpoint, tiny_config, trained_checkpoint
from .model import Model, load_model
from .tree import DraftTree
from .verify import Acceptance

__version__ = "0.1.0"

__all__ = [
    "Acceptance", "CheckpointError", "ConfigError", "DraftTree", "Dsv4TreeError", "Engine", "InputError",
    "Model", "Request", "SpecConfig", "StateError", "TreeError", "VerifyOutput", "load_model", "reference",
    "serving", "tiny_checkpoint", "tiny_config", "trained_checkpoint", "tree", "validate_spec",
]
