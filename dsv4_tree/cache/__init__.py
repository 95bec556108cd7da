"""Committed caches and the per-branch view of compressor state."""
from .state import CompressorState, GrowBuffer, LayerCache, RequestCache

__all__ = ["CompressorState", "GrowBuffer", "LayerCache", "RequestCache"]
