"""Drafters: produce one DraftTree per request."""
from .base import Drafter, TreeShape
from .dspark import DSparkDrafter
from .mtp import MtpDrafter
from .ngram import NgramDrafter
from .planted import PlantedDrafter

__all__ = ["DSparkDrafter", "Drafter", "MtpDrafter", "NgramDrafter", "PlantedDrafter", "TreeShape"]
