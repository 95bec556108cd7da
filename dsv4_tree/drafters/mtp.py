"""MTP drafter: the checkpoint's own MTP block drafts trees EAGLE-2 style, incrementally.

Step 0 runs one root row per request (pending token + the target's streams at P-1); a request
with nothing committed (P = 0: a one-token prompt) gets its root alone, as SGLang drafts only
after a target pass. Step
s >= 1 runs the draft layer only on the topk frontier rows chosen at step s-1, each
attending to its request's draft-cache window, its ancestors' rows from earlier steps (K=V
kept from when they were computed) and itself. All live requests go through one pass of the
layer per step. Children are scored by cumulative probability and the best topk expanded
next; organize_draft_results + build_tree (SGLang-compatible) give the verify trees.
eagle_topk = 1 is the chain MTP drafter. The rows the target committed since the last draft
(Request.new_hidden) enter the draft cache in step 0's pass (mtp_cache.root_step). Per-request state
lives in `caches` until `release(req)` (Engine.release calls it).

depth="adaptive": num_steps is a maximum; before each step s >= 1 `DepthPolicy.more` decides,
for the whole batch, whether it pays (drafters/depth.py); a draft that stops with fewer
candidates than num_draft_tokens - 1 gives trees of every candidate. `end_round(requests)`
after commit feeds the policy its measurements. depth="fixed" always drafts num_steps.
depth=None (the default) follows the drafting engine's SpecConfig.depth_mode on every
draft(engine, requests); an explicit depth that contradicts an explicit SpecConfig.draft_depth
is refused (ConfigError), so neither setting is silently ignored."""
from __future__ import annotations

import time
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from ..checkpoint.mtp import MtpBlock, load_mtp
from ..config import DRAFT_DEPTHS, check_topk_vocab
from ..errors import ConfigError, StateError
from ..executor.graphs import pack_windows, pad_rows
from ..ranks import agree_choice
from ..serving.buckets import pow2
from ..tree.draft_tree import DraftTree
from .base import TreeShape, draft_graphs, graphed_batch
from .depth import DepthPolicy, DraftRound
from .mtp_cache import DraftCache, fold_back, pending_rows, root_step, store_rows, window_index
from .mtp_rows import MtpRows, draft_kv_rows, head_logits, layer_rows
from .mtp_wave import Wave, fixed_wave


@dataclass
class DraftExpansion:
    """One batched EAGLE-2 expansion: organize_draft_results' inputs and the verify trees."""

    score_list: list  # [B, 1, K] then [B, K, K] per later step, cumulative, float32
    token_list: list  # [B, K] then [B, K*K]
    parents_list: list  # [B, K+1] then [B, K] global candidate ids
    trees: list  # one DraftTree per request


@dataclass
class DraftRecord:
    """Every MTP row of a request's last draft (record=True only, for inspection and tests):
    rows in expansion order (root, then each step's frontier rows) and the tree they form."""

    tree: DraftTree
    rows: MtpRows


def _drop(drafter_ref, request_id: int) -> None:
    """Finalizer of a request this drafter holds state for (the drafter itself is not kept alive)."""
    drafter = drafter_ref()
    if drafter is not None:
        drafter.release_id(request_id)


_STOPS = ("max", "exact", "cost")


def _host_split(*parts):
    """Device tensors [B, w_i] as host numpy arrays, through one copy (one host read)."""
    packed = torch.cat([p.to(torch.float32) for p in parts], 1)
    host = packed.cpu().numpy() if packed.device.type != "cpu" else packed.numpy()
    out, at = [], 0
    for p in parts:
        out.append(host[:, at : at + p.shape[1]])
        at += p.shape[1]
    return out


def _agreed_stop(model, stop: str | None) -> str:
    """The policy's answer ("max" = run the step), rank 0's on every rank of a sharded model:
    ranks time their steps differently, and a step one rank skips would hang the next collective."""
    return _STOPS[agree_choice(model, _STOPS.index(stop or "max"))]


def depth_for(drafter_depth: str | None, spec, what: str = "MtpDrafter(depth") -> str:
    """The depth a draft for an engine with `spec` runs at: the drafter's own when it was given
    one, else the spec's (SpecConfig.depth_mode). Both given and different: ConfigError naming
    `what` (the drafter's argument)."""
    if drafter_depth is None:
        return spec.depth_mode
    if spec.draft_depth is not None and spec.draft_depth != drafter_depth:
        raise ConfigError(f"{what}={drafter_depth!r}) drafts for an engine whose SpecConfig.draft_depth="
                          f"{spec.draft_depth!r}: give one of the two ({what}=None) follows the engine's spec)")
    return drafter_depth


class MtpDrafter:
    def __init__(self, model, shape: TreeShape, mtp: MtpBlock | None = None, record: bool = False,
                 depth: str | None = None, clock=time.perf_counter, graphs=False):
        """depth: None (follow the drafting engine's SpecConfig.depth_mode: adaptive for trees by
        default) | "fixed" | "adaptive"; clock: () -> seconds, the adaptive policy's timer;
        graphs: True captures a fixed-depth draft's steps after its root in a CUDA graph per batch
        bucket and replays them (drafters/mtp_wave.py; a CUDA model only), or a capture function
        of executor/graphs.py's contract (eager_capture: the same replay path on any device)."""
        if depth is not None and depth not in DRAFT_DEPTHS:
            raise ConfigError(f"MtpDrafter depth must be one of {DRAFT_DEPTHS} or None, got {depth!r}")
        check_topk_vocab(shape.topk, model.vocab_size, "TreeShape.topk")
        self.model = model
        self.mtp = mtp if mtp is not None else load_mtp(model)
        self.shape = shape
        self.record = record
        self.depth = depth
        self.clock = clock
        # made on the first adaptive draft (at once for depth="adaptive", so callers may seed it), kept across rounds
        self.policy: DepthPolicy | None = (DepthPolicy(shape.topk, shape.num_steps, shape.num_draft_tokens, clock)
                                           if depth == "adaptive" else None)
        self._measuring = False  # the last draft was adaptive: end_round reports to the policy
        self.last_round: DraftRound | None = None  # steps the last draft ran, and why it stopped
        self.caches: dict = {}  # request_id -> DraftCache
        self.records: dict = {}  # request_id -> DraftRecord of its last draft (record=True)
        self.graphs = draft_graphs(model, graphs, self._captured, "MtpDrafter")

    def end_round(self, requests, cut=()) -> None:
        """After commit of the last draft's trees: the adaptive policy learns what verify accepted
        and how long the round took (generate / generate_batch call it)."""
        if self._measuring:
            self.policy.end_round(requests, cut)

    def release(self, req) -> None:
        """Drop every per-request state of req (called by Engine.release)."""
        self.release_id(req.request_id)

    def release_id(self, request_id: int) -> None:
        self.caches.pop(request_id, None)
        self.records.pop(request_id, None)

    def _caches(self, requests) -> list:
        """Each request's draft cache (a new empty one for a request not drafted for before)."""
        for req in requests:
            if getattr(req, "released", False):
                raise StateError(f"request {req.request_id} was released; it cannot be drafted for")
        return [self.caches.get(r.request_id) or DraftCache.empty(self.model) for r in requests]

    def _keep(self, requests, caches) -> None:
        for req, cache in zip(requests, caches):
            if req.request_id not in self.caches:  # a request dropped without release leaves nothing here
                weakref.finalize(req, _drop, weakref.ref(self), req.request_id)
            self.caches[req.request_id] = cache

    @torch.inference_mode()
    def sync(self, requests) -> list:
        """The draft-extend in a pass of its own (K=V rows only, one pass for all requests): each
        request's cache brought up to its committed rows, as a draft's step 0 does it; returns the
        caches in request order."""
        model = self.model
        caches = self._caches(requests)
        todo = [(c, r) for c, r in zip(caches, requests) if r.seq_len != c.seq_len]
        if todo:
            parts = [pending_rows(model, c, r) for c, r in todo]
            raw = draft_kv_rows(model, self.mtp, *(torch.cat([p[i] for p in parts]) for i in range(3)))
            start = 0
            for (cache, req), (ids, _, _, last) in zip(todo, parts):
                store_rows(model, cache, req, raw[start : start + ids.shape[0]], last)
                start += ids.shape[0]
        self._keep(requests, caches)
        return caches

    def draft(self, engine, requests) -> list:
        depth = depth_for(self.depth, engine.spec)
        fresh = [r.seq_len == 0 for r in requests]  # no target run yet: no streams to pair the root with
        if self.shape.num_draft_tokens == 1 or all(fresh):  # nothing to draft: the root alone
            self.last_round, self._measuring = DraftRound(0, 0, "max"), False
            return [DraftTree.chain([r.root_token]) for r in requests]
        if not any(fresh):
            return self.expand(requests, depth, graphed_batch(engine, len(requests))).trees
        live = [r for r, f in zip(requests, fresh) if not f]
        drafted = iter(self.expand(live, depth, graphed_batch(engine, len(live))).trees)
        with torch.inference_mode(False):
            return [DraftTree.chain([r.root_token]) if f else next(drafted) for r, f in zip(requests, fresh)]

    def _policy(self, depth: str) -> DepthPolicy | None:
        """The adaptive policy for a draft at `depth` (None for "fixed")."""
        self._measuring = depth == "adaptive"
        if self._measuring and self.policy is None:
            s = self.shape
            self.policy = DepthPolicy(s.topk, s.num_steps, s.num_draft_tokens, self.clock)
        return self.policy if self._measuring else None

    @torch.inference_mode()
    def expand(self, requests, depth: str | None = None, graphed: bool = False) -> DraftExpansion:
        """One batched expansion. depth: "fixed" | "adaptive"; None: the drafter's own depth, or
        "fixed" when it follows an engine's spec (expand is given no engine); graphed: the batch
        is one the engine graphs (a fixed-depth draft then replays its bucket's captured wave
        when the drafter has graphs)."""
        if depth is not None and depth not in DRAFT_DEPTHS:
            raise ConfigError(f"expand depth must be one of {DRAFT_DEPTHS} or None, got {depth!r}")
        k, steps, n = self.shape.topk, self.shape.num_steps, self.shape.num_draft_tokens
        model, w = self.model, self.model.window
        caches = self._caches(requests)
        for req in requests:
            if req.seq_len == 0:
                raise StateError(f"request {req.request_id} has nothing committed: the MTP root row pairs the "
                                 "pending token with the target's streams at seq_len - 1 (draft gives it its root alone)")
        b, dev = len(requests), model.device
        policy = self._policy(depth or self.depth or "fixed")
        if policy is not None:
            policy.begin()
        # step 0, with the draft-extend of the rows committed since the last draft in the same pass
        step = root_step(model, caches, requests)
        e = step.num_pending  # the pending rows need only their K=V
        h, kv = layer_rows(model, self.mtp, step.ids, step.hidden_in, step.positions, step.table, step.index, e)
        fold_back(model, step, caches, requests, kv)
        self._keep(requests, caches)
        rows = MtpRows(head_logits(model, self.mtp, h), h[0], kv[e:])
        roots = step.ids[e:]
        seq = step.positions[e:]
        if graphed and policy is None and not self.record and self.graphs is not None:
            return self._replay(requests, caches, rows, roots, seq)
        lengths = torch.tensor([c.window.shape[0] for c in caches])  # host: index tables are built there
        wave = Wave(rows, roots, seq, torch.cat([c.window for c in caches]), k)
        stop = "max"
        if policy is not None:  # the pool, the frontier and its children's probabilities (device)
            pool, front, child = [wave.fscore], wave.fscore, wave.fscore
        for s in range(1, steps):
            if policy is not None:  # the step's one host read: all three in one copy
                stop = _agreed_stop(model, policy.more(s, *_host_split(torch.cat(pool, 1), front, child)))
                if stop != "max":
                    break
                policy.step_begin()
            wave.step(model, self.mtp, s, window_index(lengths, s, k, w, dev))
            if policy is not None:
                pool.append(wave.flat)
                front, child = wave.fscore, wave.pc.view(b, k, k).mean(1)
                policy.step_end(b)
        self.last_round = DraftRound(len(wave.score_list), steps, stop)
        if self.record:
            with torch.inference_mode(False):  # records are the caller's: ordinary tensors
                self._record(requests, wave.steps_rows, wave.step_ids, wave.rec_parents, k)
        batch, org = wave.pick(roots, n)
        if policy is None:
            trees = batch.trees()  # the draft's one host read
        else:  # the selected scores ride in the same read; their depths are the trees' own
            flat_scores = torch.cat([x.reshape(b, -1) for x in wave.score_list], 1)
            trees, sel = batch.trees_and(flat_scores.gather(1, org.top_scores_index).reshape(-1))
            m = org.top_scores_index.shape[1]
            policy.drafted(requests, np.array(sel).reshape(b, m),
                           np.array([t.host_depths[1:] for t in trees], dtype=np.int64).reshape(b, m))
        return DraftExpansion(wave.score_list, wave.token_list, wave.parents_list, trees)

    def _captured(self, key, *inputs) -> tuple:
        """The function the graphs capture: the fixed-depth wave (mtp_wave.fixed_wave)."""
        return fixed_wave(self.model, self.mtp, self.shape, *inputs)

    def _replay(self, requests, caches, rows: MtpRows, roots, seq) -> DraftExpansion:
        """Steps 1.. of a fixed-depth draft replayed in the bucket's graph, then the one read."""
        b, w, dev = len(requests), self.model.window, self.model.device
        bp = pow2(b)
        windows, lengths = pack_windows([c.window for c in caches], w)  # each request's window in its own slot
        lengths = torch.tensor(lengths, device=dev)
        inputs = (pad_rows(rows.logits, bp), pad_rows(rows.hidden, bp), pad_rows(rows.raw, bp), pad_rows(roots, bp),
                  pad_rows(seq, bp), pad_rows(windows, bp * w), pad_rows(lengths, bp))
        batch, score_list, token_list, parents_list = self.graphs.run(bp, inputs, key=("fixed",))
        self.last_round = DraftRound(len(score_list), self.shape.num_steps, "max")
        trees = batch.first(b).trees()  # the draft's one host read
        real = lambda xs: [x[:b] for x in xs]  # noqa: E731
        return DraftExpansion(real(score_list), real(token_list), real(parents_list), trees)

    def _record(self, requests, steps_rows, step_ids, rec_parents, k) -> None:
        for i, req in enumerate(requests):
            per = [slice(i, i + 1)] + [slice(i * k, (i + 1) * k)] * (len(steps_rows) - 1)
            pick = lambda xs: torch.cat([x[sl] for x, sl in zip(xs, per)])  # noqa: E731
            rows = MtpRows(*(pick([getattr(r, f) for r in steps_rows]) for f in ("logits", "hidden", "raw")))
            parents = torch.cat([p[i] for p in rec_parents]).cpu()
            self.records[req.request_id] = DraftRecord(DraftTree(pick(step_ids).cpu().long(), parents), rows)
