"""DSpark drafter: DeepSeek's block drafter drafts gamma tokens per round in one backbone pass.

Per round, for all live requests together: their contexts are brought up to date from the
target features the engine left (one context_rows call), one backbone pass runs every
request's block [anchor, noise x (gamma - 1)], then the Markov head runs left to right:
x_k = argmax (greedy runs) or a draw (sampling runs, `set_sampling`) from
softmax(U_k + W2 W1[x_{k-1}]). The chain is [anchor, x_1 .. x_gamma]: eagle_topk = 1,
num_steps = gamma, num_draft_tokens = gamma + 1. A sampled chain carries the distributions its
tokens were drawn from (`DraftTree.draft_probs`) so verify's rejection sampling is against them;
it is drawn on the device as the drawn tree without siblings (drafters/dspark_drawn.py).

eagle_topk = K > 1 drafts a Markov tree from the same backbone pass (drafters/dspark_tree.py):
num_steps <= gamma, each frontier node's top-K children from its own Markov-biased
distribution, the best num_draft_tokens - 1 candidates by path probability: top-K, never drawn,
so verify's tree rejection sampling is exact for it. A sampling run drafts a drawn tree instead
(drafters/dspark_drawn.py): the chain's drawn spine with the next best tokens beside each
spine token, tried after it, every node carrying the distribution it was drawn (or chosen) from.

size="adaptive" (or size=None under SpecConfig.draft_depth "adaptive": the default for trees,
asked for explicitly on a chain) verifies what one budget for the whole batch buys
(budget/budget_policy.py, design_notes/verify-budget.md): a chain is cut to SGLang's
confidence-scheduled length, a tree is the batch's best nodes by value, at most
num_draft_tokens per request, the budget chosen against a cost table (cost_table=, e.g. from
profile_costs) or lines learnt from the drafter's own rounds.
Per-request state (`contexts`) lives until `release(req)`. A request with nothing committed
(seq_len 0) gets its root alone, as SGLang drafts only after a prefill has run the target once.
`confidence_sts` applies SGLang's per-position STS temperatures to the confidence head."""
from __future__ import annotations

import time
import weakref
from dataclasses import dataclass

import torch

from ..budget.budget_policy import BudgetPolicy
from ..budget.cost_table import load_cost_table
from ..budget.node_values import as_value_model
from ..budget.sibling_rate import SiblingRate
from ..budget.value_events import ValueLearner
from ..checkpoint.dspark import DSparkModule, DSparkSettings
from ..checkpoint.dspark_names import load_dspark
from ..checkpoint.dspark_sts import read_sts
from ..config import DRAFT_DEPTHS, check_topk_vocab
from ..errors import ConfigError, InputError, StateError
from ..hooks import candidate_pool_size
from ..tree.draft_tree import DraftTree
from ..tree.tree_batch import TreeBatch
from .base import TreeShape, draft_graphs
from .depth import candidate_depths
from .dspark_budget import adaptive_chains, budget_trees, read_chain_budget
from .dspark_cache import DSparkContext, bring_up, pack_contexts
from .dspark_drawn import (budget_select, draw_tree, draw_uniforms, drawn_parent_rows, sibling_counts,
                           spine_confidences)
from .dspark_graphs import fixed_tree, padded_block
from .dspark_replay import captured, replay, replay_form
from .dspark_rows import confidences, markov_walk
from .dspark_tree import BRANCHINGS, MarkovExpansion, expand_markov
from .mtp import depth_for


@dataclass
class DSparkRecord:
    """A request's last draft (record=True): what the tests compare with the reference."""

    base: torch.Tensor  # [gamma, vocab] U_k
    hidden: torch.Tensor  # [gamma, hidden]
    logits: torch.Tensor  # [gamma, vocab] fp32, Markov-biased, along the drafted tokens
    confidence: torch.Tensor  # [gamma] (what an adaptive chain's length is scheduled from)
    tokens: torch.Tensor  # [gamma + 1] anchor, then the drafts


@dataclass
class DSparkTreeRecord:
    """A request's last tree draft (record=True): each node's draft distribution, for the tests."""

    tree: DraftTree
    base: torch.Tensor  # [gamma, vocab] U_k
    hidden: torch.Tensor  # [gamma, hidden]
    logits: torch.Tensor  # [nodes - 1, vocab] fp32: the distribution node 1.. was chosen from
    confidence: torch.Tensor  # [nodes - 1]: its parent's confidence


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
    """eagle_topk 1: DSpark drafts one chain of gamma tokens per round; K > 1: a Markov tree at most
    gamma deep, of at most its candidate pool + 1 nodes. Other shapes are refused by name."""
    if shape.topk > 1:
        pool = candidate_pool_size(shape.topk, shape.num_steps)
        if shape.num_steps > gamma:
            raise ConfigError(f"the DSpark drafter's trees are at most dspark_block_size={gamma} deep: "
                              f"num_steps={shape.num_steps} (needs <= {gamma})")
        if shape.num_draft_tokens - 1 > pool:
            raise ConfigError(f"num_draft_tokens={shape.num_draft_tokens}: a DSpark tree of eagle_topk={shape.topk}, "
                              f"num_steps={shape.num_steps} offers {pool} candidates (needs num_draft_tokens <= {pool + 1})")
        return
    want = dict(topk=1, num_steps=gamma, num_draft_tokens=gamma + 1)
    bad = [f"{'eagle_topk' if k == 'topk' else k}={getattr(shape, k)} (needs {v})" for k, v in want.items()
           if getattr(shape, k) != v]
    if bad:
        raise ConfigError(f"the DSpark drafter drafts a chain of dspark_block_size={gamma} tokens: "
                          f"{', '.join(bad)}")


class DSparkDrafter:
    """drafter="dspark": the checkpoint's DSpark module (module= to pass one built by hand)."""

    def __init__(self, model, shape: TreeShape, module: DSparkModule | None = None, record: bool = False,
                 size: str | None = None, branching: str = "markov", clock=time.perf_counter,
                 cost_table=None, values=None, confidence_sts=None, graphs=False):
        """size: None (follow the drafting engine's SpecConfig.depth_mode: adaptive for trees by
        default, fixed for chains) | "fixed" (the chain; num_draft_tokens tree nodes) | "adaptive"
        (the batch's verify budget); branching: "markov" | "base" (the DDTree-style baseline, for
        measurements); clock: the budget policy's timer; cost_table: a cost table or its JSON
        path (budget/cost_table.py; None: learnt online); values: a fitted node-value model
        (node_values.ValueModel; None: the prior, then fitted on this drafter's rounds);
        confidence_sts: SGLang's STS calibration file (`--speculative-dspark-confidence-sts-path`)
        or its gamma temperatures: c_k = sigmoid(raw_k / T_k) (None: T = 1); graphs: True
        captures a draft's device half (fixed size; budgeted trees and chains priced by a cost
        table, greedy or sampled) in a CUDA graph per batch bucket and replays
        it (drafters/dspark_graphs.py; a CUDA model only), or a capture function of
        executor/graphs.py's contract (eager_capture: the same replay path on any device)."""
        self.model = model
        self.module = module if module is not None else load_dspark(model)
        check_module(model, self.module)
        if not isinstance(shape, TreeShape):
            raise InputError(f"shape must be a dsv4_tree.drafters.TreeShape, got {type(shape).__name__}")
        check_chain_shape(shape, self.module.block_size)
        check_topk_vocab(shape.topk, model.vocab_size, "TreeShape.topk")
        if size is not None and size not in DRAFT_DEPTHS:
            raise ConfigError(f"DSparkDrafter size must be one of {DRAFT_DEPTHS} or None, got {size!r}")
        if branching not in BRANCHINGS:
            raise ConfigError(f"DSparkDrafter branching must be one of {BRANCHINGS}, got {branching!r}")
        self.shape = shape
        self.record = record
        self.size = size
        self.branching = branching
        self.clock = clock
        self.policy: BudgetPolicy | None = None  # made on the first adaptive draft (at once for size="adaptive")
        self.set_cost_table(cost_table)
        if size == "adaptive":
            self.policy = self._new_policy()
        self.values = ValueLearner(as_value_model(values), learn=False) if values is not None else ValueLearner()
        self.sibling_rate = SiblingRate(max(0, shape.topk - 1))  # a drawn tree's siblings (sampling runs)
        self._measuring = False  # the last draft chose its size: end_round reports to the policy
        self.contexts: dict = {}  # request_id -> DSparkContext
        self.records: dict = {}  # request_id -> DSparkRecord / DSparkTreeRecord (record=True)
        self.sampling = None  # (temperature, top_p, generator) for sampling runs; None = greedy
        # per-depth STS temperatures of the confidence head [gamma] (None: 1)
        self.temperatures = (None if confidence_sts is None else
                             torch.tensor(read_sts(confidence_sts, self.module.block_size), device=model.device))
        self.graphs = draft_graphs(model, graphs, lambda key, *inputs: captured(self, key, *inputs), "DSparkDrafter")

    @property
    def spine_depth(self) -> int:
        """A drawn draft's spine depth (dspark_drawn.sibling_counts): its uniforms per request."""
        return len(sibling_counts(self.shape.topk, self.shape.num_steps, self.shape.num_draft_tokens))

    @property
    def feature_layers(self) -> tuple:
        """Target layers (ascending) whose output streams the engine must keep for committed rows."""
        return self.module.settings.target_layer_ids

    def set_sampling(self, temperature: float | None, top_p: float = 1.0, generator=None) -> None:
        """Draw drafts (temperature > 0) or take the argmax (None): generate sets it per run."""
        self.sampling = None if temperature is None else (float(temperature), float(top_p), generator)

    def release(self, req) -> None:
        self.release_id(req.request_id)

    def release_id(self, request_id: int) -> None:
        self.contexts.pop(request_id, None)
        self.records.pop(request_id, None)
        if self.policy is not None:
            self.policy.forget(request_id)

    def set_cost_table(self, table) -> None:
        """The adaptive budget's price list from now on: a cost table (budget/cost_table.py, e.g.
        profile_costs' LineTable), the path of its JSON, or None (lines learnt from the rounds)."""
        if isinstance(table, (str, bytes)) or hasattr(table, "__fspath__"):
            table = load_cost_table(table)
        if table is not None and not callable(getattr(table, "theta", None)):
            raise ConfigError(f"cost_table must be a cost table (budget/cost_table.py), a path to one or None, "
                              f"got {type(table).__name__}")
        self.cost_table = table
        if self.policy is not None:
            self.policy.table = table

    def _new_policy(self) -> BudgetPolicy:
        return BudgetPolicy(self.shape.num_draft_tokens - 1, self.cost_table, clock=self.clock)

    def end_round(self, requests, cut=()) -> None:
        """A fixed draft has nothing to learn; an adaptive one's policy times the round, and a
        budgeted tree's value model records what verify accepted."""
        if self._measuring and self.policy is not None:
            self.policy.end_round(requests, cut)
            if self.shape.topk > 1:
                self.values.end_round(requests)
                self.sibling_rate.end_round(requests)

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
        if TreeShape.from_spec(engine.spec) != self.shape:
            raise ConfigError(f"this DSparkDrafter drafts {self.shape}; the engine's SpecConfig asks for "
                              f"{TreeShape.from_spec(engine.spec)} (build the drafter for the engine's spec)")
        if not isinstance(requests, (list, tuple)) or not requests:
            raise InputError(f"requests must be a non-empty list of Requests, got {requests!r}")
        if any(r.seq_len == 0 for r in requests):  # no target run yet: no context to draft from
            return self._without_fresh(engine, requests)
        size = depth_for(self.size, engine.spec, "DSparkDrafter(size")
        self._measuring = size == "adaptive"
        if self._measuring:  # the policy times whole rounds: from here to end_round
            if self.policy is None:
                self.policy = self._new_policy()
            self.policy.begin()
        contexts = self._contexts(requests)
        staged = [DSparkContext(c.tables, c.seq_len) for c in contexts]  # kept only if the draft succeeds
        bring_up(model, module, staged, requests)
        dev = model.device
        tables, lengths = pack_contexts(staged, model.window)
        lengths = torch.tensor(lengths, device=dev)
        anchors = torch.tensor([r.root_token for r in requests], device=dev)
        starts = torch.tensor([r.seq_len for r in requests], device=dev)
        form = replay_form(self, engine, size, len(requests))
        if form:  # the bucket's captured draft, then the one read
            trees = replay(self, form, requests, anchors, starts, tables, lengths)
            self._keep(requests, staged)
            return trees
        blk = padded_block(model, module, anchors, starts, tables, lengths, model.window)
        if self.sampling is not None or self.shape.topk > 1:  # drawn (chains and trees), or a Markov tree
            trees = (self._drawn_tree if self.sampling is not None else self._tree)(requests, blk, anchors, size)
            self._keep(requests, staged)
            return trees
        tokens, logits = markov_walk(module, blk, anchors)
        self._keep(requests, staged)
        # the token before each position (the anchor, then the drafts)
        conf = confidences(module, blk.hidden, tokens[:, :-1], self.temperatures) if self.record or self._measuring else None
        if self._measuring:  # SGLang's confidence-scheduled lengths, on the device: still the one read
            trees = adaptive_chains(self.policy, model, requests, tokens, conf)
        else:
            trees = TreeBatch.chains(tokens).trees()  # the chains in the draft's one read
        if self.record:
            with torch.inference_mode(False):  # records are the caller's: ordinary tensors
                for b, req in enumerate(requests):
                    self.records[req.request_id] = DSparkRecord(blk.base[b].clone(), blk.hidden[b].clone(),
                                                                logits[b].clone(), conf[b].clone(), tokens[b].clone())
        return trees

    def _without_fresh(self, engine, requests) -> list:
        """Requests at seq_len 0 get their root alone (SGLang's first draft follows the prefill's
        target pass); the others are drafted together."""
        rest = [r for r in requests if r.seq_len > 0]
        drafted = iter(self.draft(engine, rest) if rest else ())
        if not rest:
            self._measuring = False
        with torch.inference_mode(False):
            return [next(drafted) if r.seq_len > 0 else DraftTree.chain([r.root_token]) for r in requests]

    def _tree(self, requests, blk, anchors, size: str) -> list:
        """The Markov tree of every request (module docstring): fixed size, or the batch budget's;
        a sampling run's tree is drawn (_drawn_tree)."""
        k, steps = self.shape.topk, self.shape.num_steps
        if size == "adaptive":
            exp = expand_markov(self.module, blk, anchors, k, steps, self.branching, keep_logits=self.record,
                                temperatures=self.temperatures)
            trees, chosen = budget_trees(self.policy, self.values, self.model, requests, exp, anchors, k)
        else:
            batch, exp, org = fixed_tree(self.module, blk, anchors, self.shape, self.branching, self.temperatures,
                                         keep_logits=self.record)
            trees = batch.trees()  # the one read
            chosen = list(org.top_scores_index.cpu()) if self.record else None
        if self.record:
            with torch.inference_mode(False):
                self._record_tree(requests, trees, blk, exp, chosen, k)
        return trees

    def _drawn_tree(self, requests, blk, anchors, size: str) -> list:
        """Sampling: every request's drawn tree (drafters/dspark_drawn.py; eagle_topk 1: the drawn
        chain), all of it or, adaptive, the spine the chain's budget rule gives with the siblings
        worth at least that budget's last spine node; decided on the device, one host read (the
        budget rides in it)."""
        if self.shape.topk > 1 and self.branching != "markov":
            raise ConfigError(f"branching={self.branching!r} is a greedy measurement baseline; a sampling run drafts "
                              "drawn trees from the Markov head (branching='markov')")
        temperature, top_p, generator = self.sampling
        b, dev = anchors.shape[0], anchors.device
        u = draw_uniforms(generator, b, self.spine_depth, dev)
        drawn = draw_tree(self.module, blk, anchors, self.shape.topk, self.shape.num_steps,
                          self.shape.num_draft_tokens, temperature, top_p, u)
        conf = spine_confidences(self.module, blk, drawn, self.temperatures) if size == "adaptive" or self.record else None
        if size == "adaptive":  # the spine's length by the chain's rule, siblings worth its price: on the device
            lens = self.policy.chain_fixed(self.model, [r.request_id for r in requests], conf)
            unsettled = self.policy.unsettled()
            batch, rows = budget_select(drawn, conf, lens, unsettled[0], self.sibling_rate.rates(dev), anchors)
            trees = read_chain_budget(self.policy, self.sibling_rate if self.shape.topk > 1 else None, requests, batch,
                                      rows, unsettled)
        else:
            trees = TreeBatch(drawn.tokens, drawn_parent_rows(drawn.counts, b, dev)).trees(drawn.draw_probs)
        if self.record:
            with torch.inference_mode(False):
                for i, (req, tree) in enumerate(zip(requests, trees)):
                    if self.shape.topk == 1:  # the whole drawn chain, as a greedy chain is recorded
                        self.records[req.request_id] = DSparkRecord(
                            blk.base[i].clone(), blk.hidden[i].clone(), drawn.logits[i].clone(), conf[i].clone(),
                            drawn.spine[i].clone())
                        continue
                    d = torch.tensor(tree.host_depths[1:], dtype=torch.int64) - 1  # each node's parent depth
                    self.records[req.request_id] = DSparkTreeRecord(
                        tree, blk.base[i].cpu().clone(), blk.hidden[i].cpu().clone(),
                        drawn.logits[i].cpu()[d], conf[i].cpu()[d])
        return trees

    def _record_tree(self, requests, trees, blk, exp: MarkovExpansion, chosen: list, k: int) -> None:
        """Each node's distribution, read from the expansion's own rows (candidate id -> its parent's
        row); chosen: each tree's candidate ids [n - 1], in node order."""
        for i, req in enumerate(requests):
            depth = candidate_depths(chosen[i], k)  # [n - 1] 1-based
            front = torch.where(depth == 1, 0, (chosen[i] - k - (depth - 2) * k * k) // k)
            rows = [exp.logit_list[0][i].cpu() if d == 1 else exp.logit_list[d - 1][i, f].cpu()
                    for d, f in zip(depth.tolist(), front.tolist())]
            conf = [exp.confidence_list[0][i].cpu() if d == 1 else exp.confidence_list[d - 1][i, f].cpu()
                    for d, f in zip(depth.tolist(), front.tolist())]
            vocab = blk.base.shape[-1]
            self.records[req.request_id] = DSparkTreeRecord(
                trees[i], blk.base[i].cpu().clone(), blk.hidden[i].cpu().clone(),
                torch.stack(rows) if rows else torch.empty(0, vocab),
                torch.stack(conf) if conf else torch.empty(0))
