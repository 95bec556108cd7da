"""Acceptance and the commit mapper."""
from .accept import Acceptance, greedy_path

__all__ = ["Acceptance", "greedy_path"]
