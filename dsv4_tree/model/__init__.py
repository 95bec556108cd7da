"""The loaded model: a Hugging Face DeepseekV4ForCausalLM wrapped for tree verify (adapter.py)."""
from .adapter import Model, load_model

__all__ = ["Model", "load_model"]
