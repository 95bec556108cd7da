"""Drafters: produce one DraftTree per request."""
from .base import Drafter, TreeShape
from .ngram import NgramDrafter
from .planted import PlantedDrafter

__all__ = ["Drafter", "NgramDrafter", "PlantedDrafter", "TreeShape"]
