"""Acceptance against transformers' target: the verified logits of every tree node, put through
the call's logits processors as transformers' decoding loop would at that node, then the
greedy walk (argmax) or lossless recursive rejection sampling (softmax) over the tree."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ranks import agree_acceptances
from ..verify.accept import Acceptance, greedy_walk
from ..verify.sampling import sample_tree
from .settings import ROW_PROCESSORS


@dataclass
class NodeLengths:
    """Per tree node of a round, the length transformers' input_ids have when it predicts the
    next token there: the row's sequence so far (left padding, prompt, emitted tokens) + depth."""

    lengths: torch.Tensor  # [total nodes] int64, all trees of the round packed in order


def node_lengths(seq_lens: list, trees: list) -> NodeLengths:
    return NodeLengths(torch.cat([t.depth + n for t, n in zip(trees, seq_lens)]))


def process(processors: tuple, scores: torch.Tensor, where: NodeLengths) -> torch.Tensor:
    """The processors in order over all nodes' float32 scores [total nodes, V].

    A row processor (settings.ROW_PROCESSORS) runs once on all rows; it reads no input_ids, so
    it gets an empty [n, 0] placeholder. A length processor runs once per distinct length L on
    that length's rows with a [rows, L] placeholder: it reads input_ids.shape[-1] only."""
    if not processors:
        return scores
    dev = scores.device
    lengths = where.lengths.tolist()
    groups: dict = {}
    for row, n in enumerate(lengths):
        groups.setdefault(n, []).append(row)
    for proc in processors:
        if isinstance(proc, ROW_PROCESSORS):
            scores = proc(torch.zeros(scores.shape[0], 0, dtype=torch.long, device=dev), scores)
            continue
        out = scores.clone()
        for n, rows in groups.items():
            idx = torch.tensor(rows, device=dev)
            out[idx] = proc(torch.zeros(len(rows), n, dtype=torch.long, device=dev), scores[idx])
        scores = out
    return scores


class TreeAcceptor:
    """hooks.accept of generate_batch: greedy or sampled acceptance against the processed target.

    Greedy with no processors is the engine's own accept_greedy (one argmax per node), which
    equals transformers' argmax over the float32 logits. On a sharded model every rank takes
    rank 0's acceptances (ranks.agree_acceptances, as Engine.accept_greedy / accept_sampling
    do): each rank samples with its own global generator, and only rank 0's draws decide."""

    def __init__(self, engine, processors: tuple, do_sample: bool, device: torch.device, seq_len):
        self.engine = engine
        self.processors = processors
        self.do_sample = do_sample
        self.device = device  # input_ids' device: transformers processes the logits there
        self.seq_len = seq_len  # index -> that row's input_ids length so far

    def __call__(self, indices, requests, trees, out) -> list:
        if not self.do_sample and not self.processors:
            return self.engine.accept_greedy(requests, trees, out)
        total = sum(out.plan.num_nodes)
        with torch.inference_mode():
            # transformers: outputs.logits[:, -1].to(copy=True, dtype=torch.float32, device=input_ids.device)
            scores = out.run.logits[:total].to(dtype=torch.float32, device=self.device, copy=True)
            scores = process(self.processors, scores, node_lengths([self.seq_len(i) for i in indices], trees))
            if self.do_sample:
                probs = torch.softmax(scores.double(), dim=-1).cpu()
            else:
                targets = scores.argmax(-1).tolist()
        accs = []
        for b, (req, tree) in enumerate(zip(requests, trees)):
            o, n = out.plan.offsets[b], out.plan.num_nodes[b]
            if self.do_sample:
                # the global torch generator, as transformers' torch.multinomial draws
                path, bonus = sample_tree(tree, probs[o : o + n])
            else:
                path, bonus = greedy_walk(tree, targets[o : o + n])
            accs.append(Acceptance(tuple(path), bonus, req.request_id, out.verify_id))
        return agree_acceptances(self.engine.model, trees, accs)
