"""DSpark drafter: DeepSeek's block drafter drafts gamma tokens per round in one backbone pass.

Per round, for all live requests together: their contexts are brought up to date from the
target features the engine left (one context_rows call), one backbone pass runs every
request's block [anchor, noise x (gamma - 1)], then the Markov head runs left to right:
x_k = argmax (greedy runs) or a draw (sampling runs, `set_sampling`) from
softmax(U_k + W2 W1[x_{k-1}]). The chain is [anchor, x_1 .. x_gamma]: eagle_topk = 1,
num_steps = gamma, num_draft_tokens = gamma + 1. A sampled chain carries the distributions its
tokens were drawn from (`DraftTree.draft_probs`) so verify's rejection sampling is against them.
Per-request state (`contexts`) lives until `release(req)`."""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from ..checkpoint.dspark import DSparkModule, DSparkSettings
from ..checkpoint.dspark_names import load_dspark
from ..errors import ConfigError, InputError, StateError
from ..tree.draft_tree import DraftTree
from ..verify.sampling import target_probs
from .base import TreeShape
from .dspark_cache import DSparkContext, bring_up
from .dspark_rows import block_ids, block_index, block_rows, confidences, markov_logits


@dataclass
class DSparkRecord:
    """A request's last draft (record=True): what the tests compare with the reference."""

    base: torch.Tensor  # [gamma, vocab] U_k
    hidden: torch.Tensor  # [gamma, hidden]
    logits: torch.Tensor  # [gamma, vocab] fp32, Markov-biased, along the drafted tokens
    confidence: torch.Tensor  # [gamma] (the chain does not use it: computed for records only)
    tokens: torch.Tensor  # [gamma + 1] anchor, then the drafts


def _drop(drafter_ref, request_id: int) -> None:
    drafter = drafter_ref()
    if drafter is not None:
        drafter.release_id(request_id)


def check_module(model, module) -> None:
    """A DSpark module built by hand must fit the target it drafts for (checked once, by name)."""
    if not isinstance(module, DSparkModule):
        raise InputError(f"module must be a DSparkModule, got {type(module).__name__}")
    s = module.settings
    DSparkSettings.from_config(s.to_config(), model.config, "the DSparkDrafter's module")  # ranges, by key
    d = model.config.hidden_size
    want = {"main_proj.weight": (d, s.num_stages * d), "markov_embed.weight": (model.vocab_size, s.markov_rank)}
    for name, shape in want.items():
        got = tuple(module.state_dict()[name].shape)
        if got != shape:
            raise InputError(f"the DSparkDrafter's module: {name} has shape {got}, this target needs {shape}")
    w = module.main_proj.weight
    if w.dtype != model.dtype or w.device != model.device:
        raise InputError(f"the DSparkDrafter's module is {w.dtype} on {w.device}; the model is {model.dtype} on "
                         f"{model.device}: move it with module.to(device=..., dtype=...)")


def check_chain_shape(shape: TreeShape, gamma: int) -> None:
    """DSpark drafts one chain of gamma tokens per round; other shapes are refused by name."""
    want = dict(topk=1, num_steps=gamma, num_draft_tokens=gamma + 1)
    bad = [f"{'eagle_topk' if k == 'topk' else k}={getattr(shape, k)} (needs {v})" for k, v in want.items()
           if getattr(shape, k) != v]
    if bad:
        raise ConfigError(f"the DSpark drafter drafts a chain of dspark_block_size={gamma} tokens: "
                          f"{', '.join(bad)}")


class DSparkDrafter:
    """drafter="dspark": the checkpoint's DSpark module (module= to pass one built by hand)."""

    def __init__(self, model, shape: TreeShape, module: DSparkModule | None = None, record: bool = False):
        self.model = model
        self.module = module if module is not None else load_dspark(model)
        check_module(model, self.module)
        if not isinstance(shape, TreeShape):
            raise InputError(f"shape must be a dsv4_tree.drafters.TreeShape, got {type(shape).__name__}")
        check_chain_shape(shape, self.module.block_size)
        self.shape = shape
        self.record = record
        self.contexts: dict = {}  # request_id -> DSparkContext
        self.records: dict = {}  # request_id -> DSparkRecord (record=True)
        self.sampling = None  # (temperature, top_p, generator) for sampling runs; None = greedy

    @property
    def feature_layers(self) -> tuple:
        """Target layers whose input streams the engine must keep for committed rows."""
        return self.module.settings.target_layer_ids

    def set_sampling(self, temperature: float | None, top_p: float = 1.0, generator=None) -> None:
        """Draw drafts (temperature > 0) or take the argmax (None): generate sets it per run."""
        self.sampling = None if temperature is None else (float(temperature), float(top_p), generator)

    def release(self, req) -> None:
        self.release_id(req.request_id)

    def release_id(self, request_id: int) -> None:
        self.contexts.pop(request_id, None)
        self.records.pop(request_id, None)

    def end_round(self, requests, cut=()) -> None:
        """Nothing to learn: a DSpark chain's depth is its block size."""

    def _contexts(self, requests) -> list:
        for req in requests:
            if getattr(req, "released", False):
                raise StateError(f"request {req.request_id} was released; it cannot be drafted for")
        return [self.contexts.get(r.request_id) or DSparkContext.empty(self.model, self.module) for r in requests]

    def _keep(self, requests, contexts) -> None:
        for req, ctx in zip(requests, contexts):
            if req.request_id not in self.contexts:
                weakref.finalize(req, _drop, weakref.ref(self), req.request_id)
            self.contexts[req.request_id] = ctx

    @torch.inference_mode()
    def draft(self, engine, requests) -> list:
        model, module = self.model, self.module
        if engine.model is not model:
            raise InputError("this DSparkDrafter was built for another model than the engine's: its context comes "
                             "from the engine's target features, its embedding and head from its own model")
        check_chain_shape(TreeShape.from_spec(engine.spec), module.block_size)
        if not isinstance(requests, (list, tuple)) or not requests:
            raise InputError(f"requests must be a non-empty list of Requests, got {requests!r}")
        contexts = self._contexts(requests)
        staged = [DSparkContext(c.tables, c.seq_len) for c in contexts]  # kept only if the draft succeeds
        bring_up(model, module, staged, requests)
        dev = model.device
        lengths = torch.tensor([c.tables.shape[1] for c in staged])
        tables = torch.cat([c.tables for c in staged], 1)
        anchors = torch.tensor([r.root_token for r in requests], device=dev)
        starts = torch.tensor([r.seq_len for r in requests], device=dev)
        blk = block_rows(model, module, block_ids(module, anchors), starts, tables,
                         block_index(lengths, module.block_size).to(dev))
        tokens, logits, probs = self._walk(blk, anchors)
        self._keep(requests, staged)
        # the token before each position (the anchor, then the drafts)
        conf = confidences(module, blk.hidden, tokens[:, :-1]) if self.record else None
        with torch.inference_mode(False):  # trees and records are the caller's: ordinary tensors
            host = tokens.cpu()
            q = None if probs is None else probs.cpu()
            trees = [DraftTree.chain(host[b].clone()) if q is None else
                     DraftTree(host[b].clone(), torch.arange(host.shape[1]) - 1, draft_probs=q[b].clone())
                     for b in range(len(requests))]
            if self.record:
                for b, req in enumerate(requests):
                    self.records[req.request_id] = DSparkRecord(blk.base[b].clone(), blk.hidden[b].clone(),
                                                                logits[b].clone(), conf[b].clone(), host[b].clone())
        return trees

    def _walk(self, blk, anchors: torch.Tensor):
        """The Markov head left to right. -> (tokens [B, gamma + 1], logits [B, gamma, V] fp32,
        the draws' distributions [B, gamma, V] float64 or None)."""
        prev, toks, logits, probs = anchors, [anchors], [], []
        for k in range(self.module.block_size):
            lk = markov_logits(self.module, blk.base[:, k], prev)  # [B, V]
            if self.sampling is None:
                prev = lk.argmax(-1)
            else:
                temperature, top_p, generator = self.sampling
                q = target_probs(lk.cpu(), temperature, top_p)  # [B, V] float64
                probs.append(q)
                prev = torch.multinomial(q, 1, generator=generator).squeeze(1).to(anchors.device)
            logits.append(lk)
            toks.append(prev)
        return torch.stack(toks, 1), torch.stack(logits, 1), torch.stack(probs, 1) if probs else None
