"""Exceptions raised by dsv4_tree. Every bad input maps to one of these, never to a bare
IndexError deep inside torch, and none of them is raised after committed state changed."""


class Dsv4TreeError(Exception):
    """Base class of every error this package raises on purpose."""


class ConfigError(Dsv4TreeError, ValueError):
    """A SpecConfig (or model config) combination that cannot be served."""


class TreeError(Dsv4TreeError, ValueError):
    """A malformed draft tree or malformed SGLang-style tree tensors."""


class InputError(Dsv4TreeError, ValueError):
    """Bad request input: token ids, positions, batch list lengths, dtypes, devices."""


class CheckpointError(Dsv4TreeError, ValueError):
    """A checkpoint directory that cannot be loaded (missing files, wrong model type)."""


class StateError(Dsv4TreeError, RuntimeError):
    """An operation that does not fit a request's committed state (e.g. a stale verify)."""
