"""`custom_generate`: tree speculation as the decoding loop of transformers' own `generate`.

    out = model.generate(input_ids, custom_generate=dsv4_tree.custom_generate, max_new_tokens=64)

transformers prepares the generation config, logits processors, stopping criteria and model
kwargs as for any `generate` call, then calls this in place of its `_sample` loop. We read
what was asked (settings.py), run every row through one engine's `generate_batch` (one
draft pass and one verify per round for the whole batch; the engine is kept on the model,
its pools sized for the call: engines.py), accept against transformers' own target
(target.py) and return transformers' layout (columns.py)."""
from __future__ import annotations

import dataclasses

import logging
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from transformers.generation.utils import GenerateDecoderOnlyOutput, GenerationMixin

from ..config import SpecConfig
from ..errors import CheckpointError, ConfigError, InputError, StateError
from ..generate_batch import generate_batch
from ..checkpoint.files import shard_files
from ..checkpoint.dspark_names import find_dspark, has_dspark
from ..checkpoint.mtp import MTP_PREFIX
from ..drafters.base import TreeShape, default_tree_nodes
from ..drafters.dspark import check_chain_shape
from .columns import Columns
from .engines import ENGINES_ATTR, checkpoint_dir, engine_for
from .settings import read_request
from .target import TreeAcceptor

log = logging.getLogger("dsv4_tree.hf_generate")

# The tree when generation_config sets none of our keys: the fastest measured on the trained
# checkpoint (benchmarks/bench_accept.py, README): the MTP block's topk-4 tree of 8 nodes in 2
# draft steps (20 candidates already fill its 7 draft slots; a third step costs a draft pass
# for +0.05 tokens per verify), and for the n-gram trie topk 4, 3 steps, 8 nodes.
DEFAULT_SHAPES = {"mtp": (4, 2, 8), "ngram": (4, 3, 8)}
SHAPE_KEYS = ("dsv4_eagle_topk", "dsv4_num_steps", "dsv4_num_draft_tokens")


def has_mtp(path: Path | None) -> bool:
    """Whether the checkpoint's safetensors hold an MTP block (names only, nothing read); `mtp.*`
    tensors of a bundled DSpark module (dspark_* config keys) are not one."""
    if path is None or not list(path.glob("*.safetensors")):
        return False
    found = find_dspark(path)
    if found is not None and found[0] == Path(path):
        return False
    for f in shard_files(path):
        with safe_open(str(f), framework="pt") as fh:
            if any(k.startswith(MTP_PREFIX) for k in fh.keys()):
                return True
    return False


def dspark_shape(path: Path | None) -> tuple:
    """DSpark's chain for the checkpoint's block size gamma: topk 1, gamma steps, gamma + 1 nodes."""
    found = find_dspark(path) if path is not None else None
    if found is None:
        raise InputError(f"dsv4_drafter='dspark': the checkpoint {path} has no DSpark module (no dspark_* keys in "
                         "its config.json and no dspark/ subfolder)")
    gamma = found[1].get("dspark_block_size")
    if not isinstance(gamma, int) or isinstance(gamma, bool) or gamma < 1:
        raise CheckpointError(f"{found[2]}: dspark_block_size must be an int >= 1, got {gamma!r}")
    return 1, gamma, gamma + 1


def choose_tree(hf, gc, given: dict) -> tuple[str, SpecConfig]:
    """(drafter name, spec) from our keys (custom_generate kwargs, else generation_config
    attributes): dsv4_drafter "dspark" | "mtp" | "ngram", dsv4_eagle_topk / dsv4_num_steps /
    dsv4_num_draft_tokens. Unset: DSpark when the checkpoint has a DSpark module (its chain of
    gamma drafts), else MTP when it has an MTP block, else n-gram, each at its DEFAULT_SHAPES tree."""
    def key(name):
        return given[name] if given.get(name) is not None else getattr(gc, name, None)

    drafter = key("dsv4_drafter")
    path = checkpoint_dir(hf)
    if drafter is None:
        drafter = "dspark" if has_dspark(path) else "mtp" if has_mtp(path) else "ngram"
    if drafter not in DEFAULT_SHAPES and drafter != "dspark":
        raise InputError(f"dsv4_drafter={drafter!r}: choose one of {sorted([*DEFAULT_SHAPES, 'dspark'])}")
    topk, steps, nodes = (key(k) for k in SHAPE_KEYS)
    dk, ds, dn = dspark_shape(path) if drafter == "dspark" else DEFAULT_SHAPES[drafter]
    topk, steps = dk if topk is None else topk, ds if steps is None else steps
    if nodes is None and (topk, steps) == (dk, ds):
        nodes = dn
    if drafter == "dspark":  # the drafter's own shape rules, by our keys' names
        try:
            TreeShape(topk, steps, 1)  # ints >= 1, before any arithmetic on them
            if nodes is None and topk > 1:  # its Markov tree: the CLI's --topk default size
                nodes = default_tree_nodes(topk, steps)
            check_chain_shape(TreeShape(topk, steps, nodes if nodes is not None else steps + 1), ds)
        except ConfigError as exc:
            raise ConfigError(f"dsv4_eagle_topk={topk}, dsv4_num_steps={steps}, dsv4_num_draft_tokens={nodes}: "
                              f"{exc}") from None
    return drafter, SpecConfig(eagle_topk=topk, num_steps=steps, num_draft_tokens=nodes)


def generate_locals() -> dict:
    """The locals of the transformers `generate` call that called us ({} when called directly).

    transformers 5.23 hands a callable custom_generate neither `streamer` nor `synced_gpus`
    nor `assistant_model` (_extract_generation_mode_kwargs keeps only keys outside _sample's
    signature), yet has already put the prompt to the streamer: reading them from its frame is
    the only way to honour them, or to refuse them (tests/test_hf_generate.py checks it)."""
    code = getattr(GenerationMixin.generate, "__wrapped__", GenerationMixin.generate).__code__
    frame = sys._getframe(1)
    for _ in range(8):
        if frame is None:
            break
        if frame.f_code is code:
            return dict(frame.f_locals)
        frame = frame.f_back
    return {}


def custom_generate(model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None,
                    synced_gpus=False, streamer=None, dsv4_drafter=None, dsv4_eagle_topk=None,
                    dsv4_num_steps=None, dsv4_num_draft_tokens=None, **model_kwargs):
    """transformers' decoding-loop signature (GenerationMixin._sample's) plus our tree keys.

    Returns `sequences` [batch, input_len + new] (prompts as given, finished rows padded with
    pad_token_id), or GenerateDecoderOnlyOutput(sequences=...) with return_dict_in_generate."""
    caller = generate_locals()
    streamer = streamer if streamer is not None else caller.get("streamer")
    gc = generation_config if generation_config is not None else model.generation_config
    caller = {**caller, "synced_gpus": synced_gpus or caller.get("synced_gpus")}
    ask = read_request(input_ids, logits_processor, stopping_criteria, gc, model_kwargs, caller)
    given = {"dsv4_drafter": dsv4_drafter, "dsv4_eagle_topk": dsv4_eagle_topk, "dsv4_num_steps": dsv4_num_steps,
             "dsv4_num_draft_tokens": dsv4_num_draft_tokens}
    drafter, spec = choose_tree(model, gc, given)
    if ask.do_sample and spec.depth_mode != "fixed":
        # an adaptive tree's shape follows measured times, and with it which draws speculation
        # makes: sampled runs draft fixed trees, so torch.manual_seed fixes the tokens
        spec = dataclasses.replace(spec, draft_depth="fixed")
    engine = engine_for(model, spec, ask.prompts, ask.budget)
    log.info("dsv4_tree.custom_generate: %s drafter, eagle_topk=%d num_steps=%d num_draft_tokens=%d",
             drafter, spec.eagle_topk, spec.num_steps, spec.num_draft_tokens)
    columns = Columns(input_ids.shape[1], len(ask.prompts), ask.pad, streamer)
    hooks = _Hooks(TreeAcceptor(engine, ask.processors, ask.do_sample, input_ids.device, columns.seq_len), columns)
    results = generate_batch(engine, ask.prompts, ask.budget, drafter=drafter, eos_token_id=list(ask.eos) or None,
                             progress=False, hooks=hooks)
    check_finished(results, ask.budget, engine)
    new = columns.finish().to(input_ids.device)
    sequences = torch.cat([input_ids, new], dim=1)
    if ask.return_dict:
        return GenerateDecoderOnlyOutput(sequences=sequences)
    return sequences


def check_finished(results: list, budget: int, engine) -> None:
    """Every row ended at its budget or an EOS. A row cut short for want of pool pages raises:
    a shorter row is never returned as finished. (engine_for sizes the pools for every row at
    once; they fall short only when other requests hold the engine's pages.)"""
    for b, res in enumerate(results):
        if res.stop_reason == "out_of_pages":
            layout = engine.runtime.layout
            raise StateError(f"custom_generate: row {b} ran out of pool pages after {len(res.tokens)} of "
                             f"max_new_tokens={budget} new tokens: the engine's token pool holds "
                             f"{layout.num_token_pages} pages of {layout.page_size} slots "
                             f"(SpecConfig.max_total_tokens={engine.spec.max_total_tokens}, max_requests="
                             f"{engine.spec.max_requests}), sized for this call's rows alone; release the other "
                             f"requests of model.{ENGINES_ATTR}'s engines, or delete that attribute")


class _Hooks:
    """generate_batch's hooks: acceptance against transformers' target, tokens into columns."""

    def __init__(self, accept: TreeAcceptor, columns: Columns):
        self.accept = accept
        self.emitted = columns.emitted
