"""Training the small byte-level DeepSeek-V4 checkpoint (with its MTP block)."""
from .corpus import decode, encode, load_corpus
from .trainer import BYTE_MODEL, TrainConfig, train

__all__ = ["BYTE_MODEL", "TrainConfig", "decode", "encode", "load_corpus", "train"]
