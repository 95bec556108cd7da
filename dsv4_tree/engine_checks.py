"""The Engine's argument and state checks: every bad input gets its specific dsv4_tree error
before anything is written (a mixin of Engine; it reads self.model, self.limits, self.engine_id)."""
from __future__ import annotations

import itertools

import torch

from .errors import InputError, StateError
from .request import Request, VerifyOutput, check_live
from .verify.accept import Acceptance
from .tree.draft_tree import DraftTree, depth_by_pointer_jumping


def packed_max_depth(trees, sizes, starts) -> list:
    """Max depth of every tree, from one pointer-jumping pass over all trees packed together."""
    if sum(sizes) == len(trees):  # every tree a lone root (plain decoding): depth 0, no pass
        return [0] * len(trees)
    parents = torch.cat([t.parents for t in trees])
    offset = torch.repeat_interleave(torch.tensor(starts), torch.tensor(sizes), output_size=parents.numel())
    depth = depth_by_pointer_jumping(torch.where(parents >= 0, parents + offset, parents))
    which = torch.repeat_interleave(torch.arange(len(trees)), torch.tensor(sizes), output_size=parents.numel())
    return torch.zeros(len(trees), dtype=torch.int64).scatter_reduce_(0, which, depth, "amax").tolist()


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_hidden_rows(hidden_rows) -> int:
    if not _is_int(hidden_rows) or hidden_rows < 0:
        raise InputError(f"hidden_rows must be an int >= 0 (or None for sliding_window + 1), got {hidden_rows!r}")
    return hidden_rows


def _last_rows(t: torch.Tensor, keep: int) -> torch.Tensor:
    """The last `keep` rows of t (none for keep = 0, where t[-0:] would be all of them)."""
    return t[t.shape[0] - min(keep, t.shape[0]):]


class EngineChecks:
    # ---------------------------------------------------------------- validation
    def _check_own(self, requests) -> None:
        """StateError for a released request or one another Engine made (its row indexes that
        engine's page tables, not ours)."""
        check_live(requests)
        for b, req in enumerate(requests):
            if req.engine_id != self.engine_id:
                raise StateError(f"requests[{b}] (request {req.request_id}) belongs to another Engine: its row and "
                                 "committed state live in that engine's pools; use that engine")

    def _check_adopted(self, tokens, row: int, seq_len) -> None:
        """Engine.adopt's committed part: seq_len ids in `tokens`, and pages behind them."""
        limit = self.limits.max_positions
        if not _is_int(seq_len) or not 0 <= seq_len < limit:
            raise InputError(f"seq_len must be an int in [0, {limit}) (max_position_embeddings={limit}), got {seq_len!r}")
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or tokens.is_floating_point() \
                or tokens.is_complex() or tokens.dtype == torch.bool:
            what = f"shape {tuple(tokens.shape)} {tokens.dtype}" if isinstance(tokens, torch.Tensor) else type(tokens).__name__
            raise InputError(f"tokens must be a 1-D tensor of integer token ids, got {what}")
        if tokens.numel() != seq_len:
            raise InputError(f"tokens holds {tokens.numel()} ids but seq_len={seq_len}: one id per committed position")
        self._check_ids(tokens, "tokens")
        rt = self.runtime
        if not rt.pages.backs(row, seq_len, seq_len - rt.layout.recent_window):
            raise StateError(
                f"seq_len={seq_len}: row {row} has no committed state behind it: seq_len committed positions need "
                f"token pages for positions < {seq_len} (the row maps {rt.pages.mapped[row] * rt.pages.page_size} "
                f"slots) and recent pages from position {max(0, seq_len - rt.layout.recent_window)} on; map and "
                "write them first (runtime.pages.ensure, as serving/synth.py does), or adopt with seq_len=0 and prefill")

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

    def _check_requests(self, requests, num_trees: int) -> None:
        """The request list's own checks (also for accept with the verified trees)."""
        if not isinstance(requests, (list, tuple)):
            raise InputError("requests and trees must be lists")
        if len(requests) != num_trees:
            raise InputError(f"{len(requests)} requests but {num_trees} trees: one tree per request")
        if not requests:
            raise InputError("verify needs at least one request")
        if len({id(r) for r in requests}) != len(requests):
            raise InputError("the same request appears twice in one verify call")
        for b, req in enumerate(requests):
            if not isinstance(req, Request):
                raise InputError(f"requests[{b}] is a {type(req).__name__}, not a dsv4_tree.Request")
        self._check_own(requests)

    def _check_batch(self, requests, trees, enforce_limits: bool = True) -> None:
        if not isinstance(requests, (list, tuple)) or not isinstance(trees, (list, tuple)):
            raise InputError("requests and trees must be lists")
        self._check_requests(requests, len(trees))
        for b, tree in enumerate(trees):
            if not isinstance(tree, DraftTree):
                raise InputError(f"trees[{b}] is a {type(tree).__name__}, not a dsv4_tree.DraftTree")
            if enforce_limits and tree.num_nodes > self.limits.max_nodes:
                raise InputError(f"trees[{b}] has {tree.num_nodes} nodes; num_draft_tokens allows {self.limits.max_nodes}")
        if all(t.is_made for t in trees):  # the engine's own drafts: their host lists, no tensor read
            self._check_made(requests, trees, enforce_limits)
            return
        # the tensor checks run once over all trees packed together (a fixed number of ops)
        sizes = [t.num_nodes for t in trees]
        starts = list(itertools.accumulate([0] + sizes[:-1]))
        tokens = torch.cat([t.tokens for t in trees])
        v = self.model.vocab_size
        lo, hi = torch.aminmax(tokens)
        if int(lo) < 0 or int(hi) >= v:
            for b, tree in enumerate(trees):
                self._check_ids(tree.tokens, f"trees[{b}].tokens")
        for b, (req, root) in enumerate(zip(requests, tokens[starts].tolist())):
            if root != req.root_token:
                raise InputError(f"trees[{b}] root token {root} is not the request's pending root token {req.root_token}")
        for b, (req, depth) in enumerate(zip(requests, packed_max_depth(trees, sizes, starts))):
            if enforce_limits and depth > self.limits.max_depth:
                raise InputError(f"trees[{b}] has depth {depth}; num_steps allows {self.limits.max_depth}")
            if req.seq_len + depth >= self.limits.max_positions:
                raise InputError(f"trees[{b}] reaches position {req.seq_len + depth}; "
                                 f"max_position_embeddings={self.limits.max_positions}")

    def _check_made(self, requests, trees, enforce_limits: bool) -> None:
        """_check_batch's per-tree limits for trees DraftTree.made built (the engine's own drafts):
        roots and depths from their host lists; token ids and node order hold by construction."""
        for b, (req, tree) in enumerate(zip(requests, trees)):
            root = tree.host_lists()[0][0]
            if root != req.root_token:
                raise InputError(f"trees[{b}] root token {root} is not the request's pending root token {req.root_token}")
            depth = tree.max_depth
            if enforce_limits and depth > self.limits.max_depth:
                raise InputError(f"trees[{b}] has depth {depth}; num_steps allows {self.limits.max_depth}")
            if req.seq_len + depth >= self.limits.max_positions:
                raise InputError(f"trees[{b}] reaches position {req.seq_len + depth}; "
                                 f"max_position_embeddings={self.limits.max_positions}")

    def _check_out(self, requests, trees, out: VerifyOutput) -> None:
        if not isinstance(out, VerifyOutput):
            raise InputError(f"out must be the VerifyOutput of verify(), got {type(out).__name__}")
        if (isinstance(trees, (list, tuple)) and len(trees) == len(out.plan.trees)
                and all(a is b for a, b in zip(trees, out.plan.trees))):
            # the very trees verify checked: the requests, and each root (a tree edited in place
            # since would show there first), need checking; host ints, no tensor ops
            self._check_requests(requests, len(trees))
            for b, (req, tree) in enumerate(zip(requests, trees)):
                root = tree.host_lists()[0][0] if tree.is_made else int(tree.tokens[0])
                if root != req.root_token:
                    raise InputError(f"trees[{b}] root token {root} is not the request's pending "
                                     f"root token {req.root_token}")
        else:
            self._check_batch(requests, trees, enforce_limits=False)
        if tuple(r.request_id for r in requests) != out.request_ids:
            raise InputError("requests differ from those of the verify call that produced `out`")
        if tuple(r.seq_len for r in requests) != out.seq_lens:
            raise StateError("a request was committed since this verify ran; verify again")
        for b, r in enumerate(requests):
            if r.scratch_owner != out.verify_id:
                raise StateError(f"requests[{b}]'s draft rows no longer hold this output's (verified again since, "
                                 "or a verify or commit failed part-way); use the newer output or verify again")
        for b, (tree, planned) in enumerate(zip(trees, out.plan.trees)):
            if tree is not planned and not (
                torch.equal(tree.tokens, planned.tokens) and torch.equal(tree.parents, planned.parents)
            ):
                raise InputError(f"trees[{b}] is not the tree verified for requests[{b}]")

    def _check_commit(self, requests, accs, out: VerifyOutput) -> list:
        """Every check of Engine.commit (nothing written yet) -> each request's accepted node ids
        (host ints, root first)."""
        if not isinstance(out, VerifyOutput):
            raise InputError(f"out must be the VerifyOutput of verify(), got {type(out).__name__}")
        if not isinstance(requests, (list, tuple)) or not isinstance(accs, (list, tuple)):
            raise InputError(f"requests and accs must be lists, got {type(requests).__name__} and "
                             f"{type(accs).__name__}")
        if len(requests) != len(accs):
            raise InputError(f"{len(requests)} requests but {len(accs)} acceptances")
        self._check_own(requests)
        if tuple(r.request_id for r in requests) != out.request_ids:
            raise InputError("requests differ from those of the verify call that produced the acceptances")
        if tuple(r.seq_len for r in requests) != out.seq_lens:
            raise StateError("a request was committed since this verify ran; verify again")
        paths = []
        for b, (req, acc, tree) in enumerate(zip(requests, accs, out.plan.trees)):
            if not isinstance(acc, Acceptance) or acc.verify_id != out.verify_id or acc.request_id != req.request_id:
                raise StateError(f"accs[{b}] does not belong to this verify output and request")
            if req.scratch_owner != out.verify_id:
                raise StateError(f"requests[{b}]'s draft rows no longer hold this output's (verified again since, "
                                 "or a verify or commit failed part-way); verify again")
            if not isinstance(acc.path, (list, tuple)) or not all(_is_int(i) for i in acc.path):
                raise InputError(f"accs[{b}].path must be a tuple of int node ids, got {acc.path!r}")
            if not _is_int(acc.bonus):
                raise InputError(f"accs[{b}].bonus must be an int token id, got {acc.bonus!r}")
            nodes = list(acc.path)
            if not nodes or nodes[0] != 0:
                raise InputError(f"accs[{b}].path must start at the root (node 0)")
            # host ints: each node's parent is the node before it (a root-to-node path)
            parents = tree.host_lists()[1] if len(nodes) > 1 else [-1]
            if not 0 <= min(nodes) <= max(nodes) < tree.num_nodes or any(parents[c] != a for a, c in zip(nodes, nodes[1:])):
                raise InputError(f"accs[{b}].path {acc.path} is not a root-to-node path of the verified tree")
            if not 0 <= acc.bonus < self.model.vocab_size:
                raise InputError(f"accs[{b}].bonus: token id {acc.bonus} outside the vocabulary "
                                 f"[0, {self.model.vocab_size})")
            if req.seq_len + len(nodes) >= self.limits.max_positions:
                raise InputError(f"accs[{b}] would reach max_position_embeddings={self.limits.max_positions}")
            paths.append(nodes)
        return paths
