"""The loaded model: a Hugging Face DeepseekV4ForCausalLM wrapped for tree verify (adapter.py).
Its names load on first access (PEP 562): they need the `hf` extra (transformers 5.23.0)."""
from ..lazy import lazy_attributes

_LAZY = {"Model": ".adapter", "load_model": ".adapter"}

__all__ = ["Model", "load_model"]

__getattr__, __dir__ = lazy_attributes(__name__, globals(), _LAZY)
