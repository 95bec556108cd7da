"""The engine `custom_generate` runs on: one per model, tree, device and dtype, kept on the model
(pools allocated and the MTP block read once), its pools sized for the request.

A row holds at most its prompt + max_new_tokens + one tree's draft slots in the token pool at
once (draft node i sits at slot P + i). The kept engine serves a call when its pools hold every
row of it at the same time; otherwise it is replaced by one whose pools do, so `generate_batch`
never has to preempt a row or end one `out_of_pages`. The replacement keeps the default pool
size (SpecConfig.max_total_tokens None: min(max_requests x max_position_embeddings, 2**18)
tokens) when that holds the rows, else takes their token count rounded up to a power of two
(a few sizes over a session, not one engine per length)."""
from __future__ import annotations

from pathlib import Path

from ..config import SpecConfig
from ..engine import Engine
from ..hooks import validate_spec
from ..model.adapter import Model
from ..serving.buckets import pow2
from ..serving.pools import Layout
from ..serving.runtime import make_layout

ENGINES_ATTR = "_dsv4_tree_engines"  # on the model: (tree spec, device, dtype) -> Engine


def checkpoint_dir(hf) -> Path | None:
    """The local directory the model was loaded from (config._name_or_path), if any."""
    name = getattr(hf.config, "_name_or_path", None)
    path = Path(name) if name else None
    return path if path is not None and path.is_dir() else None


def holds(layout: Layout, slots: list) -> bool:
    """Whether pools of this layout hold rows of these token slots all at once (each row maps
    whole pages)."""
    pages = sum(-(-s // layout.page_size) for s in slots)
    return len(slots) <= layout.max_requests and pages <= layout.num_token_pages


def pool_spec(hf, spec: SpecConfig, slots: list, kept: Engine | None = None) -> SpecConfig:
    """`spec` with pools that hold these rows at once, and at least the rows of the kept engine
    this replaces: its pool size when that holds them, else their token count rounded up to a
    power of two."""
    old = kept.spec if kept is not None else spec
    sized = spec.replace(max_requests=max(spec.max_requests, pow2(len(slots)), old.max_requests),
                         max_total_tokens=old.max_total_tokens)
    if holds(make_layout(Model(hf), sized, validate_spec(hf.config, sized)), slots):  # sizes only
        return sized
    return sized.replace(max_total_tokens=pow2(sum(slots)))


def engine_for(hf, spec: SpecConfig, prompts: list, budget: int) -> Engine:
    """The model's engine for this tree, with pools for every prompt + budget at once."""
    limits = validate_spec(hf.config, spec)  # a bad tree is refused before anything is sized
    # past max_position_embeddings generate_batch refuses the budget (check_room)
    slots = [min(len(p) + budget, limits.max_positions) + limits.max_nodes for p in prompts]
    engines = hf.__dict__.setdefault(ENGINES_ATTR, {})
    key = (spec, hf.lm_head.weight.device, hf.lm_head.weight.dtype)
    kept = engines.get(key)
    if kept is not None and holds(kept.runtime.layout, slots):
        return kept
    sized = pool_spec(hf, spec, slots, kept)
    engines.pop(key, None)  # a kept engine too small for this call is dropped
    engine = Engine(hf, sized)
    engine.model.source = checkpoint_dir(hf)
    engines[key] = engine
    return engine
