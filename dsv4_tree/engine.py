"""Engine: prefill, verify, accept, commit over our own committed caches."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from .attention.backend import get_backend
from .attention.plan import VerifyPlan, build_plan
from .cache.state import RequestCache
from .config import SpecConfig
from .errors import ConfigError, InputError, StateError
from .hooks import validate_spec
from .model.adapter import Model, load_model
from .model.forward import RowsRun, run_rows
from .tree import BuiltTree, TreeMaskMode, trees_to_tensors
from .tree.draft_tree import DraftTree
from .verify import commit as commit_mod
from .verify.accept import Acceptance, greedy_path
from .verify.sampling import sample_path, target_probs

_ids = itertools.count()


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class Request:
    """One sequence's committed state. seq_len = P committed (KV-ready) positions; root_token
    is the pending token at position P. Only Engine.commit / prefill change it."""

    tokens: torch.Tensor  # [P] committed token ids
    root_token: int
    cache: RequestCache = field(repr=False)
    request_id: int = field(default_factory=lambda: next(_ids))
    # target residual streams (before hc_head) of the last rows the latest prefill/commit added
    # (at most sliding_window + 1 of them by default), positions seq_len - n .. seq_len - 1:
    # what an MTP drafter extends its sliding-window cache with
    new_hidden: torch.Tensor | None = field(default=None, repr=False)  # [n, hc_mult, hidden]

    @property
    def seq_len(self) -> int:
        return self.cache.seq_len


@dataclass
class VerifyOutput:
    """logits[b]: [N_b, vocab], row i = node i of trees[b]. The rest is for commit."""

    logits: list
    plan: VerifyPlan = field(repr=False)
    run: RowsRun = field(repr=False)
    request_ids: tuple = ()
    seq_lens: tuple = ()
    verify_id: int = 0

    @property
    def topk_ties(self) -> int:
        return self.run.topk_ties


class Engine:
    """Tree (or chain) speculative verify for one DeepSeek-V4 model."""

    def __init__(self, model, spec: SpecConfig | None = None):
        if spec is not None and not isinstance(spec, SpecConfig):
            raise ConfigError(f"spec must be a dsv4_tree.SpecConfig (or None), got {type(spec).__name__}; "
                              "build one with SpecConfig(**fields) or SpecConfig.from_file(path)")
        self.model: Model = load_model(model)
        self.spec = spec if spec is not None else SpecConfig()
        self.limits = validate_spec(self.model.config, self.spec)
        self.ops = get_backend(self.spec.attention_backend)
        self._verify_ids = itertools.count(1)
        self._last: VerifyOutput | None = None  # the latest accepted verify, for commit(requests, accs)

    # ---------------------------------------------------------------- validation
    def _check_ids(self, ids: torch.Tensor, what: str) -> None:
        v = self.model.vocab_size
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= v):
            bad = ids[(ids < 0) | (ids >= v)][0]
            raise InputError(f"{what}: token id {int(bad)} outside the vocabulary [0, {v})")

    def _as_prompt(self, prompt_ids) -> torch.Tensor:
        if isinstance(prompt_ids, torch.Tensor):
            if prompt_ids.is_floating_point() or prompt_ids.dtype == torch.bool:
                raise InputError(f"prompt_ids must hold integer token ids, got dtype {prompt_ids.dtype}")
            ids = prompt_ids.detach().cpu().long()
        else:
            try:
                ids = torch.as_tensor(list(prompt_ids))
            except (TypeError, ValueError, RuntimeError) as exc:
                raise InputError(f"prompt_ids must be a sequence of ints: {exc}") from exc
            if ids.numel() and (ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool):
                raise InputError(f"prompt_ids must hold integer token ids, got {ids.dtype} values")
            ids = ids.long()
        if ids.dim() == 2 and ids.shape[0] == 1:
            ids = ids[0]
        if ids.dim() != 1:
            raise InputError(f"prompt_ids must be 1-D, got shape {tuple(ids.shape)}")
        if ids.numel() == 0:
            raise InputError("prompt_ids is empty: a request needs at least one token")
        self._check_ids(ids, "prompt_ids")
        limit = self.limits.max_positions
        if ids.numel() > limit - 1:
            raise InputError(
                f"prompt of {ids.numel()} tokens leaves no position for generation: max_position_embeddings={limit}"
            )
        return ids

    def _check_batch(self, requests, trees, enforce_limits: bool = True) -> None:
        if not isinstance(requests, (list, tuple)) or not isinstance(trees, (list, tuple)):
            raise InputError("requests and trees must be lists")
        if len(requests) != len(trees):
            raise InputError(f"{len(requests)} requests but {len(trees)} trees: one tree per request")
        if not requests:
            raise InputError("verify needs at least one request")
        if len({id(r) for r in requests}) != len(requests):
            raise InputError("the same request appears twice in one verify call")
        for b, (req, tree) in enumerate(zip(requests, trees)):
            if not isinstance(req, Request):
                raise InputError(f"requests[{b}] is a {type(req).__name__}, not a dsv4_tree.Request")
            if not isinstance(tree, DraftTree):
                raise InputError(f"trees[{b}] is a {type(tree).__name__}, not a dsv4_tree.DraftTree")
            self._check_ids(tree.tokens, f"trees[{b}].tokens")
            if int(tree.tokens[0]) != req.root_token:
                raise InputError(
                    f"trees[{b}] root token {int(tree.tokens[0])} is not the request's pending root token "
                    f"{req.root_token}"
                )
            if enforce_limits:
                if tree.num_nodes > self.limits.max_nodes:
                    raise InputError(
                        f"trees[{b}] has {tree.num_nodes} nodes; num_draft_tokens allows {self.limits.max_nodes}"
                    )
                if tree.max_depth > self.limits.max_depth:
                    raise InputError(f"trees[{b}] has depth {tree.max_depth}; num_steps allows {self.limits.max_depth}")
            last = req.seq_len + tree.max_depth
            if last >= self.limits.max_positions:
                raise InputError(
                    f"trees[{b}] reaches position {last}; max_position_embeddings={self.limits.max_positions}"
                )

    # ---------------------------------------------------------------- steps
    def _run(self, requests, trees, logit_rows=None):
        plan = build_plan(trees, [r.seq_len for r in requests], self.model.window, self.model.ratios)
        plan = plan.to(self.model.device)
        run = run_rows(self.model, plan, [r.cache for r in requests], self.ops, logit_rows)
        return plan, run

    def prefill(self, prompt_ids, hidden_rows: int | None = None) -> Request:
        """Commit prompt[:-1] (KV-ready) and leave prompt[-1] as the pending root token.

        hidden_rows: how many of the last rows' target streams to keep in Request.new_hidden
        (default sliding_window + 1, all a sliding-window draft layer can use)."""
        keep = self.model.window + 1 if hidden_rows is None else hidden_rows
        ids = self._as_prompt(prompt_ids)
        req = Request(ids[:0].clone(), int(ids[-1]), self.model.new_cache())
        body = ids[:-1]
        chunk = self.spec.prefill_chunk
        hidden = []
        for start in range(0, body.numel(), chunk):
            part = body[start : start + chunk]
            tree = DraftTree.chain(part)
            plan, run = self._run([req], [tree], logit_rows=torch.tensor([part.numel() - 1]))
            path = torch.arange(part.numel())
            updates = commit_mod.commit_plan(self.model, req.cache, run.layers, 0, plan.requests[0], path)
            commit_mod.apply(req.cache, updates, req.seq_len + part.numel())
            req.tokens = torch.cat([req.tokens, part])
            hidden.append(run.hidden)
            if sum(h.shape[0] for h in hidden) > keep:  # bounded: at most keep + one chunk
                hidden = [torch.cat(hidden)[-keep:]]
        req.new_hidden = torch.cat(hidden)[-keep:] if hidden else None
        return req

    def verify(self, requests, trees) -> VerifyOutput:
        """Logits of every node of every tree; committed state is never changed."""
        self._check_batch(requests, trees)
        plan, run = self._run(requests, trees)
        logits = [run.logits[rp.row_offset : rp.row_offset + rp.num_nodes] for rp in plan.requests]
        return VerifyOutput(
            logits, plan, run, tuple(r.request_id for r in requests), tuple(r.seq_len for r in requests),
            next(self._verify_ids),
        )

    def accept_greedy(self, requests, trees, out: VerifyOutput) -> list:
        """Longest path where each node is the target's argmax at its parent (SGLang order)."""
        self._check_out(requests, trees, out)
        accs = []
        for b, (req, tree) in enumerate(zip(requests, trees)):
            path, bonus = greedy_path(tree, out.logits[b])
            accs.append(Acceptance(tuple(path), bonus, req.request_id, out.verify_id))
        self._last = out
        return accs

    def accept_sampling(self, requests, trees, out: VerifyOutput, temperature: float = 1.0,
                        top_p: float = 1.0, generator: torch.Generator | None = None) -> list:
        """Lossless recursive rejection sampling against the target (see verify/sampling.py)."""
        self._check_out(requests, trees, out)
        if generator is not None and not isinstance(generator, torch.Generator):
            raise InputError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
        accs = []
        for b, (req, tree) in enumerate(zip(requests, trees)):
            probs = target_probs(out.logits[b].cpu(), temperature, top_p)
            path, bonus = sample_path(tree, probs, generator)
            accs.append(Acceptance(tuple(path), bonus, req.request_id, out.verify_id))
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
        """Prefill, then draft -> verify -> accept -> commit rounds. See dsv4_tree/generate.py."""
        from .generate import generate

        return generate(self, prompt_ids, max_new_tokens, drafter, temperature, top_p, eos_token_id,
                        generator, progress)

    def _check_out(self, requests, trees, out: VerifyOutput) -> None:
        self._check_batch(requests, trees, enforce_limits=False)
        if not isinstance(out, VerifyOutput):
            raise InputError(f"out must be the VerifyOutput of verify(), got {type(out).__name__}")
        if tuple(r.request_id for r in requests) != out.request_ids:
            raise InputError("requests differ from those of the verify call that produced `out`")
        if tuple(r.seq_len for r in requests) != out.seq_lens:
            raise StateError("a request was committed since this verify ran; verify again")
        for b, (tree, rp) in enumerate(zip(trees, out.plan.requests)):
            if tree is not rp.tree and not (
                torch.equal(tree.tokens, rp.tree.tokens) and torch.equal(tree.parents, rp.tree.parents)
            ):
                raise InputError(f"trees[{b}] is not the tree verified for requests[{b}]")

    def commit(self, requests, accs, out: VerifyOutput | None = None) -> None:
        """Fold each request's accepted path into its cache; the bonus becomes the next root.

        All requests' new states are computed before any is applied: on error, none changes."""
        out = out if out is not None else getattr(self, "_last", None)
        if out is None:
            raise StateError("commit needs the VerifyOutput its acceptances came from")
        if not isinstance(out, VerifyOutput):
            raise InputError(f"out must be the VerifyOutput of verify(), got {type(out).__name__}")
        if not isinstance(requests, (list, tuple)) or not isinstance(accs, (list, tuple)):
            raise InputError(f"requests and accs must be lists, got {type(requests).__name__} and "
                             f"{type(accs).__name__}")
        if len(requests) != len(accs):
            raise InputError(f"{len(requests)} requests but {len(accs)} acceptances")
        if tuple(r.request_id for r in requests) != out.request_ids:
            raise InputError("requests differ from those of the verify call that produced the acceptances")
        if tuple(r.seq_len for r in requests) != out.seq_lens:
            raise StateError("a request was committed since this verify ran; verify again")
        staged = []
        for b, (req, acc, rp) in enumerate(zip(requests, accs, out.plan.requests)):
            if not isinstance(acc, Acceptance) or acc.verify_id != out.verify_id or acc.request_id != req.request_id:
                raise StateError(f"accs[{b}] does not belong to this verify output and request")
            if not isinstance(acc.path, (list, tuple)) or not all(_is_int(i) for i in acc.path):
                raise InputError(f"accs[{b}].path must be a tuple of int node ids, got {acc.path!r}")
            if not _is_int(acc.bonus):
                raise InputError(f"accs[{b}].bonus must be an int token id, got {acc.bonus!r}")
            path = torch.as_tensor(acc.path, dtype=torch.int64)
            tree = rp.tree
            if path.numel() == 0 or int(path[0]) != 0:
                raise InputError(f"accs[{b}].path must start at the root (node 0)")
            if int(path.max()) >= tree.num_nodes or not torch.equal(tree.path[path[-1], : path.numel()], path):
                raise InputError(f"accs[{b}].path {acc.path} is not a root-to-node path of the verified tree")
            self._check_ids(torch.tensor([acc.bonus]), f"accs[{b}].bonus")
            if req.seq_len + path.numel() >= self.limits.max_positions:
                raise InputError(f"accs[{b}] would reach max_position_embeddings={self.limits.max_positions}")
            updates = commit_mod.commit_plan(self.model, req.cache, out.run.layers, b, rp, path)
            hidden = out.run.hidden[rp.row_offset : rp.row_offset + rp.num_nodes][path.to(out.run.hidden.device)]
            staged.append((req, updates, tree.tokens[path], acc.bonus, path.numel(), hidden[-(self.model.window + 1):]))
        for req, updates, toks, bonus, n, hidden in staged:
            commit_mod.apply(req.cache, updates, req.seq_len + n)
            req.tokens = torch.cat([req.tokens, toks])
            req.root_token = int(bonus)
            req.new_hidden = hidden
