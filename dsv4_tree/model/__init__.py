"""Loading DeepSeek-V4 checkpoints and running verify rows through them (the `hf` extra:
transformers 5.23.0). The public names load on first access (PEP 562), so the torch-only
helpers here (`casts`) import without transformers."""
import importlib

_LAZY = {
    "Model": ".adapter", "load_model": ".adapter", "write_release": ".release",
    "tiny_checkpoint": ".tiny", "tiny_config": ".tiny", "trained_checkpoint": ".tiny",
    "write_random_checkpoint": ".tiny",
}

__all__ = ["Model", "load_model", "tiny_checkpoint", "tiny_config", "trained_checkpoint", "write_random_checkpoint",
           "write_release"]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
