"""dsv4-tree: tree speculative verify for DeepSeek-V4 attention, equal to per-path runs.

The trees, the serving tables, the references and the kernels import with torch alone. The
Hugging Face engine (`Engine`, `Model`, the loaders) needs the `hf` extra (transformers 5.23.0)
and loads on first use of one of its names (PEP 562), so `import dsv4_tree.tree` (or the SGLang
plug-in, beside SGLang's own transformers pin) never imports transformers."""
from .lazy import lazy_attributes

from . import reference, serving, tree
from .config import SpecConfig
from .errors import CheckpointError, ConfigError, Dsv4TreeError, InputError, StateError, TreeError
from .hooks import validate_spec
from .tree import DraftTree
from .verify import Acceptance

__version__ = "0.1.0"

# name -> module that defines it; loaded on first access (they import transformers)
_LAZY = {
    "Engine": ".engine", "Request": ".engine", "VerifyOutput": ".engine", "custom_generate": ".hf_generate",
    "Model": ".model", "load_model": ".model", "tiny_checkpoint": ".checkpoint", "tiny_config": ".checkpoint",
    "trained_checkpoint": ".checkpoint",
}

__all__ = [
    "Acceptance", "CheckpointError", "ConfigError", "DraftTree", "Dsv4TreeError", "Engine", "InputError",
    "Model", "Request", "SpecConfig", "StateError", "TreeError", "VerifyOutput", "custom_generate", "load_model",
    "reference", "serving", "tiny_checkpoint", "tiny_config", "trained_checkpoint", "tree", "validate_spec",
]

__getattr__, __dir__ = lazy_attributes(__name__, globals(), _LAZY)
