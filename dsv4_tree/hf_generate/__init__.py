"""Tree speculation inside transformers' `model.generate(..., custom_generate=...)`."""
from .run import custom_generate

__all__ = ["custom_generate"]
