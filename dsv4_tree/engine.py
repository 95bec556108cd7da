"""Engine: prefill, verify, accept, commit over the paged serving pools."""
from __future__ import annotations

import itertools
import weakref
from dataclasses import replace

import torch

from .attention.backend import get_backend
from .config import SpecConfig, check_topk_vocab
from .errors import ConfigError, InputError, StateError
from .engine_checks import EngineChecks, _check_hidden_rows, _is_int, _last_rows
from .hooks import validate_spec
from .model.adapter import Model, load_model
from .executor.forward import run_rows
from .executor.graphs import GraphCache
from .ranks import agree_acceptances, check_same
from .request import Request, TokenHistory, VerifyOutput, accumulated_ties
from .serving.runtime import ServingRuntime
from .serving.tables import VerifyPlan
from .tree import BuiltTree, TreeMaskMode, trees_to_tensors
from .tree.draft_tree import DraftTree
from .verify.accept_batch import device_drawn, device_greedy, device_sample
from .verify.accept import Acceptance, greedy_walk
from .verify.sampling import sample_tree, target_probs

__all__ = ["Engine", "Request", "VerifyOutput"]

_engine_ids = itertools.count(1)


class Engine(EngineChecks):
    """Tree (or chain) speculative verify for one DeepSeek-V4 model."""

    def __init__(self, model, spec: SpecConfig | None = None):
        if spec is not None and not isinstance(spec, SpecConfig):
            raise ConfigError(f"spec must be a dsv4_tree.SpecConfig (or None), got {type(spec).__name__}; "
                              "build one with SpecConfig(**fields) or SpecConfig.from_file(path)")
        self.model: Model = load_model(model)
        self.spec = spec if spec is not None else SpecConfig()
        check_topk_vocab(self.spec.eagle_topk, self.model.vocab_size)
        self.limits = validate_spec(self.model.config, self.spec)
        self.ops = get_backend(self.spec.attention_backend)
        self.runtime = ServingRuntime(self.model, self.spec, self.limits, kernels=self.ops.kernels)
        self._graphs = None  # GraphCache, created on the first bucketed verify on CUDA
        self._verify_ids = itertools.count(1)
        self.engine_id = next(_engine_ids)  # stamped on every Request this engine makes
        self._row_owner: dict = {}  # page-table row -> weakref to the Request adopted on it
        self._last: VerifyOutput | None = None  # the latest accepted verify, for commit(requests, accs)
        self.named_drafters: dict = {}  # drafter name -> drafter built for this engine (drafters/registry.py)
        self._drafters = weakref.WeakSet()  # drafters told about Engine.release
        self.feature_layers: tuple = ()  # target layers whose output streams committed rows keep (register_drafter)

    # ---------------------------------------------------------------- request lifecycle
    def register_drafter(self, drafter) -> None:
        """Engine.release(req) will call drafter.release(req). A drafter naming `feature_layers`
        (DSpark) makes prefill and commit keep those target layers' output streams for the rows
        they add (Request.new_features); register it before prefill."""
        layers = tuple(getattr(drafter, "feature_layers", ()) or ())
        n = self.model.config.num_hidden_layers
        if any(not _is_int(i) or not 0 <= i < n for i in layers) or list(layers) != sorted(set(layers)):
            raise ConfigError(f"{type(drafter).__name__}.feature_layers {list(layers)} must be distinct target "
                              f"layers in [0, {n}), ascending (features concatenate in layer order)")
        if layers and self.feature_layers and layers != self.feature_layers:
            raise ConfigError(f"this engine keeps the features of target layers {list(self.feature_layers)}; a "
                              f"drafter reading layers {list(layers)} needs an engine of its own")
        self._drafters.add(drafter)
        if layers and layers != self.feature_layers:
            self.feature_layers = layers
            self._graphs = None  # captured steps were recorded without the features

    # ---------------------------------------------------------------- steps
    def prefill(self, prompt_ids, hidden_rows: int | None = None) -> Request:
        """Commit prompt[:-1] (KV-ready) and leave prompt[-1] as the pending root token.

        hidden_rows: how many of the last rows' target streams to keep in Request.new_hidden
        (default sliding_window + 1, all a sliding-window draft layer can use)."""
        return self.prefill_batch([prompt_ids], hidden_rows)[0]

    def prefill_batch(self, prompts, hidden_rows: int | None = None) -> list:
        """prefill for many prompts at once: each forward runs the next prefill_chunk tokens of
        every prompt that has some left. All prompts are validated first; on any error no
        request is left behind."""
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise InputError(f"prompts must be a non-empty list of prompts, got {type(prompts).__name__}")
        keep = self.model.window + 1 if hidden_rows is None else _check_hidden_rows(hidden_rows)
        ids = [self._as_prompt(p) for p in prompts]
        check_same(self.model, ids, "prompts")  # sharded model: every rank prefills the same prompts
        rt, dev, chunk = self.runtime, self.model.device, self.spec.prefill_chunk
        reqs = []
        try:
            for x in ids:
                reqs.append(self.adopt(x[:0].clone(), int(x[-1]), rt.admit()))
            hidden, feats = [[] for _ in reqs], [[] for _ in reqs]
            for start in range(0, max(x.numel() for x in ids) - 1, chunk):
                live = [i for i, x in enumerate(ids) if x.numel() - 1 > start]
                parts = [ids[i][start : min(start + chunk, ids[i].numel() - 1)] for i in live]
                rows, lens = [reqs[i].row for i in live], [reqs[i].seq_len for i in live]
                plan = rt.plan(rows, lens, [DraftTree.chain(p) for p in parts])
                last = torch.tensor([o + n - 1 for o, n in zip(plan.offsets, plan.num_nodes)], device=dev)
                run = run_rows(self.model, plan.to(dev), rt.pools, self.ops, last, self.feature_layers)
                rt.commit(rows, lens, [torch.arange(p.numel()) for p in parts])
                for i, part, o in zip(live, parts, plan.offsets):
                    req, n = reqs[i], part.numel()
                    req.seq_len += n
                    req.history.append(part)
                    hidden[i] = [_last_rows(torch.cat(hidden[i] + [run.hidden[o : o + n]]), keep)]
                    if self.feature_layers:
                        feats[i] = [_last_rows(torch.cat(feats[i] + [run.features[o : o + n]]), self.model.window)]
                    req._add_ties(run.topk_ties[o : o + n].sum())
        except BaseException:
            for req in reqs:
                self.release(req)
            raise
        for req, h in zip(reqs, hidden):
            req.new_hidden = h[0] if h else None
        for req, f in zip(reqs, feats):
            req.new_features = f[0] if f else None
        return reqs

    def adopt(self, tokens: torch.Tensor, root_token: int, row: int, seq_len: int = 0) -> Request:
        """A Request owning page-table row `row` (slots return to the pools when it is released
        or garbage-collected). `row` must come from `engine.runtime.admit()` and not be held by
        another live request. seq_len > 0 adopts committed state already in the pools: `tokens`
        holds its seq_len ids, and the row's pages must map every position < seq_len (with recent
        pages for the last recent_window), written by the caller (serving/synth.py)."""
        pages = self.runtime.pages
        if not _is_int(row) or not 0 <= row < pages.max_requests:
            raise InputError(f"row must be an int in [0, {pages.max_requests}) (SpecConfig.max_requests), got {row!r}")
        if not pages.is_admitted(row):
            raise StateError(f"row {row} was not admitted: take one from engine.runtime.admit()")
        owner = self._row_owner.get(row)
        owner = owner() if owner is not None else None
        if owner is not None and not owner.released:
            raise StateError(f"row {row} is held by live request {owner.request_id}; release it first")
        self._check_adopted(tokens, row, seq_len)
        if not _is_int(root_token) or not 0 <= root_token < self.model.vocab_size:
            raise InputError(f"root_token must be a token id in [0, {self.model.vocab_size}), got {root_token!r}")
        req = Request(TokenHistory(tokens), root_token, row, seq_len, engine_id=self.engine_id)
        req.finalizer = weakref.finalize(req, self.runtime.release_row, row)
        self._row_owner[row] = weakref.ref(req)
        return req

    def plan(self, requests, trees) -> VerifyPlan:
        """Host schedule of verify (validate, map draft slots, one packed host-to-device copy),
        then the batch's tables built on the device (serving/tables.py)."""
        self._check_batch(requests, trees)
        check_same(self.model, [[r.seq_len for r in requests]] + [t.tokens for t in trees]
                   + [t.parents for t in trees], "verified requests or trees")  # sharded model: ranks agree
        limit = self.spec.cuda_graph_max_bs
        bucketed = len(trees) <= (limit if limit is not None else self.spec.max_requests if self._graphed() else 0)
        return self.runtime.plan([r.row for r in requests], [r.seq_len for r in requests], trees,
                                 bucketed=bucketed, graphed=bucketed and self._graphed())

    def run_plan(self, plan: VerifyPlan, requests) -> VerifyOutput:
        """Device half of verify: one forward over all rows (no host synchronisation inside)."""
        if tuple(r.row for r in requests) != plan.rows or tuple(r.seq_len for r in requests) != plan.seq_lens:
            raise StateError("the plan was built for other requests or an older committed state; plan again")
        self._check_own(requests)
        # the forward overwrites these requests' draft slots: from here until it returns, no
        # earlier verify output of theirs may commit (a failure half-way leaves them refused)
        for r in requests:
            r.scratch_owner = 0
        run, plan = self._forward(plan)
        vid = next(self._verify_ids)
        for r in requests:
            r.scratch_owner = vid
        logits = [run.logits[o : o + n] for o, n in zip(plan.offsets, plan.num_nodes)]
        return VerifyOutput(logits, plan, run, tuple(r.request_id for r in requests), plan.seq_lens, vid)

    def _graphed(self) -> bool:
        """Bucketed steps replay one captured graph (table build + forward) per bucket: on CUDA."""
        return self.model.device.type == "cuda"

    def _forward(self, plan: VerifyPlan) -> tuple:
        """The verify forward -> (RowsRun, the plan with its tables); a graphed plan (bucketed,
        on CUDA) replays its bucket's captured build + forward."""
        if plan.staged is None:
            return run_rows(self.model, plan.to(self.model.device), self.runtime.pools, self.ops,
                            feature_layers=self.feature_layers), plan
        if self._graphs is None:
            self._graphs = GraphCache(self.model, self.runtime, self.ops, feature_layers=self.feature_layers)
        run, tables = self._graphs.run(plan.staged, plan.bucket)
        return run, replace(plan, **tables, staged=None)

    def verify(self, requests, trees) -> VerifyOutput:
        """Logits of every node of every tree; committed state is never changed."""
        return self.run_plan(self.plan(requests, trees), requests)

    def accept_greedy(self, requests, trees, out: VerifyOutput) -> list:
        """Longest path where each node is the target's argmax at its parent (SGLang order)."""
        self._check_out(requests, trees, out)
        accs = []
        if all(t.is_made for t in trees):  # the engine's own drafts: accepted on the device, one read
            for req, (path, bonus) in zip(requests, device_greedy(trees, out)):
                accs.append(Acceptance(path, bonus, req.request_id, out.verify_id))
        else:
            # one argmax and one host copy for the whole batch (out.logits[b] are slices of run.logits)
            targets = out.run.logits[: sum(out.plan.num_nodes)].argmax(-1).tolist()
            for b, (req, tree) in enumerate(zip(requests, trees)):
                o, n = out.plan.offsets[b], out.plan.num_nodes[b]
                path, bonus = greedy_walk(tree, targets[o : o + n])
                accs.append(Acceptance(tuple(path), bonus, req.request_id, out.verify_id))
        accs = agree_acceptances(self.model, trees, accs)  # sharded model: rank 0's, on every rank
        self._last = out
        return accs

    def accept_sampling(self, requests, trees, out: VerifyOutput, temperature: float = 1.0,
                        top_p: float = 1.0, generator: torch.Generator | None = None) -> list:
        """Lossless recursive rejection sampling against the target (see verify/sampling.py)."""
        self._check_out(requests, trees, out)
        if generator is not None and not isinstance(generator, torch.Generator):
            raise InputError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
        accs = []
        made = all(t.is_made for t in trees)
        drawn = [t.draft_probs is not None for t in trees]
        if made and (all(drawn) or not any(drawn)):  # the engine's own trees: on the device, one read
            accept = device_drawn if all(drawn) else device_sample
            for req, (path, bonus) in zip(requests, accept(trees, out, temperature, top_p, generator)):
                accs.append(Acceptance(path, bonus, req.request_id, out.verify_id))
        else:
            for b, (req, tree) in enumerate(zip(requests, trees)):
                probs = target_probs(out.logits[b].cpu(), temperature, top_p)
                path, bonus = sample_tree(tree, probs, generator)
                accs.append(Acceptance(tuple(path), bonus, req.request_id, out.verify_id))
        accs = agree_acceptances(self.model, trees, accs)  # sharded model: rank 0's draws decide
        self._last = out
        return accs

    def tree_tensors(self, requests, trees) -> BuiltTree:
        """The SGLang-compatible verify tensors of these trees (what build_tree returns), with the
        tree mask in this engine's spec.mask_mode layout. Trees need equal node counts (SGLang
        pads every request to num_draft_tokens)."""
        self._check_batch(requests, trees)
        seq_lens = [r.seq_len for r in requests]
        return BuiltTree(**trees_to_tensors(list(trees), seq_lens, TreeMaskMode[self.spec.mask_mode]))

    def generate(self, prompt_ids, max_new_tokens: int, drafter=None, temperature: float | None = None,
                 top_p: float = 1.0, eos_token_id=None, generator=None, progress=None):
        """Prefill, then draft -> verify -> accept -> commit rounds; drafter: "mtp" | "ngram" |
        "planted" | an object with draft(engine, requests). See dsv4_tree/generate.py."""
        from .generate import generate

        return generate(self, prompt_ids, max_new_tokens, drafter, temperature, top_p, eos_token_id,
                        generator, progress)

    def generate_batch(self, prompts, max_new_tokens, drafter=None, temperature: float | None = None,
                       top_p: float = 1.0, eos_token_id=None, generator=None, progress=None) -> list:
        """Many prompts together: one draft pass and one verify per round for all live
        requests; each finishes on its own. See dsv4_tree/generate_batch.py."""
        from .generate_batch import generate_batch

        return generate_batch(self, prompts, max_new_tokens, drafter, temperature, top_p, eos_token_id,
                              generator, progress)

    def commit(self, requests, accs, out: VerifyOutput | None = None) -> None:
        """Fold each request's accepted path into its cache; the bonus becomes the next root.

        All requests' new states are computed before any is applied: on error, none changes."""
        out = out if out is not None else getattr(self, "_last", None)
        if out is None:
            raise StateError("commit needs the VerifyOutput its acceptances came from")
        paths = self._check_commit(requests, accs, out)  # accepted node ids per request, host ints
        # every index the device needs (the accepted rows of the run) rides in the moves' one
        # host-to-device copy; the gathers below are a fixed number of ops whatever the batch
        keep, flat, tail, seg = self.model.window + 1, [], [], []
        for b, (o, nodes) in enumerate(zip(out.plan.offsets, paths)):
            flat += [o + a for a in nodes]
            tail += [o + a for a in nodes[-keep:]]
            seg += [b] * len(nodes)
        flat_host = torch.tensor(flat, dtype=torch.int64)
        rows, lens = [r.row for r in requests], [r.seq_len for r in requests]
        moves = self.runtime.prepare_commit(rows, lens, paths, (flat_host, torch.tensor(tail, dtype=torch.int64),
                                                                torch.tensor(seg, dtype=torch.int64)))
        flat_dev, tail_dev, seg_dev = moves.carried
        run = out.run
        sizes = [min(len(n), keep) for n in paths]
        hidden = run.hidden[tail_dev].split(sizes)
        feats = [None] * len(paths) if run.features is None else run.features[tail_dev].split(sizes)
        path_ties = run.topk_ties.new_zeros(len(requests)).index_add_(0, seg_dev, run.topk_ties[flat_dev])
        ties = accumulated_ties([r.ties for r in requests], path_ties)
        tokens = torch.cat([t.tokens for t in out.plan.trees])[flat_host].split([len(n) for n in paths])

        def spend() -> None:
            # the moves overwrite draft slots (a move's destination can be another's source): from
            # the first copy on, a failure must leave `out` refused, as a retry would read
            # moved-over rows; committed positions < P are never written, so they hold
            for req in requests:
                req.scratch_owner = 0
            if self._last is out:
                self._last = None

        self.runtime.apply_commit(moves, rows, [p + len(n) for p, n in zip(lens, paths)], spend)
        for req, acc, toks, h, f, t in zip(requests, accs, tokens, hidden, feats, ties):
            req.ties = t
            req.seq_len += toks.numel()
            req.history.append(toks)
            req.root_token = int(acc.bonus)
            req.new_hidden = h
            req.new_features = None if f is None else f[-self.model.window:]
            req.scratch_owner = 0

    def release(self, req: Request) -> None:
        """The request is finished: return every slot it holds to the pools and drop its state
        here and in every registered drafter. A released request cannot be used again."""
        if not isinstance(req, Request):
            raise InputError(f"release needs a dsv4_tree.Request, got a {type(req).__name__}")
        self._check_own([req])
        req.released = True
        if self._last is not None and req.request_id in self._last.request_ids:
            self._last = None
        req.new_hidden = None
        req.new_features = None
        req.finalizer()  # runs release_row once, and never again at garbage collection
        for drafter in list(self._drafters):
            drafter.release(req)

    def state_summary(self, req: Request) -> list:
        """The request's committed state per layer in Hugging Face cache-field names (host copies)."""
        self._check_own([req])
        return self.runtime.committed_view(req.row, req.seq_len)
