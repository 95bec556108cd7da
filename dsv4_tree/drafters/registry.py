"""Drafters by name: "mtp" | "dspark" | "ngram" | "planted" | an object with draft(engine, requests).

A name builds the drafter for the engine's tree shape once and keeps it on the engine (the
MTP block's weights are read once per engine, not per call), leaving the global RNG as it was. Every resolved drafter with a
`release(req)` method is registered with the engine, so Engine.release drops its
per-request state."""
from __future__ import annotations

import torch

from ..errors import InputError
from .base import TreeShape

DRAFTER_NAMES = ("mtp", "dspark", "ngram", "planted")


def _build(name: str, engine):
    """The named drafter, built without touching the global RNG: a module's construction draws
    initial weights (then overwritten by the checkpoint's), and a run seeded with
    torch.manual_seed must draw the same tokens whether or not it built the drafter."""
    dev = torch.device(engine.model.device)
    with torch.random.fork_rng(devices=[dev.index or 0] if dev.type == "cuda" else []):
        return _construct(name, engine)


def _construct(name: str, engine):
    shape = TreeShape.from_spec(engine.spec)
    if name == "mtp":
        from .mtp import MtpDrafter

        return MtpDrafter(engine.model, shape)  # depth=None: follows engine.spec.draft_depth
    if name == "dspark":
        from .dspark import DSparkDrafter

        return DSparkDrafter(engine.model, shape)
    if name == "ngram":
        from .ngram import NgramDrafter

        return NgramDrafter(shape)
    from .planted import PlantedDrafter

    return PlantedDrafter(engine.model, shape)


def resolve_drafter(engine, drafter, default: str = "ngram"):
    """The drafter object for `drafter` (None = `default`); InputError names the choices."""
    if drafter is None:
        drafter = default
    if isinstance(drafter, str):
        if drafter not in DRAFTER_NAMES:
            raise InputError(f"drafter={drafter!r} is not a drafter name; choose one of {', '.join(DRAFTER_NAMES)} "
                             "or pass an object with a draft(engine, requests) method")
        named = engine.named_drafters
        if drafter not in named:
            named[drafter] = _build(drafter, engine)
        drafter = named[drafter]
    elif isinstance(drafter, type) or not callable(getattr(drafter, "draft", None)):
        raise InputError(f"drafter must be one of {', '.join(map(repr, DRAFTER_NAMES))} or an object with a "
                         f"draft(engine, requests) method; got {_describe(drafter)}")
    if callable(getattr(drafter, "release", None)):
        engine.register_drafter(drafter)
    return drafter


def _describe(drafter) -> str:
    if isinstance(drafter, type):
        return f"the class {drafter.__name__} (pass an instance)"
    return f"a {type(drafter).__name__}"


def tell_sampling(drafter, temperature: float | None, top_p: float, generator) -> None:
    """A drafter that draws its drafts (`set_sampling`: DSpark) learns the run's rule: draws at
    `temperature` (None: a greedy run, argmax drafts) with the run's generator."""
    if callable(getattr(drafter, "set_sampling", None)):
        drafter.set_sampling(temperature, top_p, generator)
