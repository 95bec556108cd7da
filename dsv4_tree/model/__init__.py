"""The loaded model: a Hugging Face DeepseekV4ForCausalLM wrapped for tree verify (adapter.py).
Its names load on first access (PEP 562): they need the `hf` extra (transformers 5.23.0)."""
import importlib

_LAZY = {"Model": ".adapter", "load_model": ".adapter"}

__all__ = ["Model", "load_model"]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
