"""Drafters: produce one DraftTree per request."""
from .base import Drafter, TreeShape
from .mtp import MtpDrafter
from .ngram import NgramDrafter
from .planted import PlantedDrafter

__all__ = ["Drafter", "MtpDrafter", "NgramDrafter", "PlantedDrafter", "TreeShape"]
