"""Reference EAGLE-2 drafting with the MTP block by full recompute (one request at a time).

Every draft step reruns the Hugging Face decoder layer, dense and masked, over the request's
committed window rows plus every row expanded so far (root, then each step's topk frontier
rows); expansion and selection are those of the drafter (cumulative scores, stable sort,
organize_draft_results / build_tree). The incremental drafter (drafters/mtp.py) must produce
the same trees."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..tree.build import build_tree, organize_draft_results
from ..tree.convert import tensors_to_trees
from ..tree.draft_tree import DraftTree
from .mtp import mtp_masked_rows


@dataclass
class ReferenceDraft:
    score_list: list  # as DraftExpansion: [1, 1, K] then [1, K, K]
    token_list: list  # [1, K] then [1, K*K]
    parents_list: list  # [1, K+1] then [1, K]
    tree: DraftTree


def committed_mtp_inputs(req, window: int):
    """The draft layer's inputs for the committed rows a draft can see, from a request fresh
    out of Engine.prefill (Request.new_hidden holds the last window + 1 target streams):
    (tokens [L], input streams [L, hc, d], positions [L], root streams [hc, d]). The rows are
    SGLang's draft-extend rows, placed one position later: position q >= 1 pairs x_q with the
    streams at q - 1; none pairs x_0 with anything (reference/mtp_extend.py)."""
    p, h = req.seq_len, req.new_hidden
    if p < 1:
        raise ValueError("committed_mtp_inputs: nothing committed (P = 0), no target streams to draft from")
    n = min(p - 1, window)  # rows at positions p - n .. p - 1, all >= 1
    if h is None or h.shape[0] < n + 1:
        raise ValueError("committed_mtp_inputs needs a request fresh out of prefill (new_hidden of window + 1 rows)")
    streams = h[-(n + 1):]  # positions p-n-1 .. p-1
    return req.tokens[p - n :], streams[:-1], torch.arange(p - n, p), streams[-1]


@torch.no_grad()
def full_recompute_draft(model, mtp, req, topk: int, num_steps: int, num_draft_tokens: int) -> ReferenceDraft:
    k, w = topk, model.window
    ctoks, chid, cpos, root_hidden = committed_mtp_inputs(req, w)
    c = ctoks.numel()
    toks, parents, hid = [req.root_token], [-1], [root_hidden]

    def forward():
        tree = DraftTree(torch.tensor(toks, dtype=torch.int64), torch.tensor(parents, dtype=torch.int64))
        pos = torch.cat([cpos, req.seq_len + tree.depth])
        link = torch.zeros(c + tree.num_nodes, c + tree.num_nodes, dtype=torch.bool)
        link[:c, :c] = torch.ones(c, c, dtype=torch.bool).tril()
        link[c:, :c] = True
        link[c:, c:] = tree.ancestors
        visible = link & (pos.view(-1, 1) - pos.view(1, -1) < w)
        logits, out = mtp_masked_rows(model, mtp, torch.cat([ctoks, tree.tokens]),
                                      torch.cat([chid, torch.stack(hid)]), pos, visible)
        return logits[c:], out[c:]

    logits, out = forward()
    p0, t0 = torch.softmax(logits[0].float(), -1).topk(k)
    score_list, token_list = [p0.view(1, 1, k).cpu()], [t0.view(1, k).cpu()]
    parents_list = [torch.tensor([[-1] + list(range(k))])]
    frontier = [(int(t0[j]), float(p0[j]), 0) for j in range(k)]  # (token, score, parent row)
    for step in range(1, num_steps):
        first = len(toks)
        for tok, _, prow in frontier:
            toks.append(tok)
            parents.append(prow)
            hid.append(out[prow])
        logits, out = forward()
        pc, tc = torch.softmax(logits[first : first + k].float(), -1).topk(k, dim=-1)  # [k, k]
        scores = torch.tensor([f[1] for f in frontier]).unsqueeze(1) * pc.cpu()
        score_list.append(scores.view(1, k, k))
        token_list.append(tc.cpu().reshape(1, k * k))
        flat = scores.reshape(-1)
        chosen = torch.sort(flat, descending=True, stable=True).indices[:k]
        parents_list.append((chosen + k * k * (step - 1) + k).view(1, k))
        frontier = [(int(tc.reshape(-1)[i]), float(flat[i]), first + int(i) // k) for i in chosen]
    org = organize_draft_results(score_list, token_list, parents_list, num_draft_tokens)
    built = build_tree(torch.tensor([req.root_token]), org.parent_list, org.top_scores_index, org.draft_tokens,
                       torch.tensor([req.seq_len]), k, num_steps, num_draft_tokens)
    tree = tensors_to_trees(built.draft_tokens, built.retrieve_next_token, built.retrieve_next_sibling)[0]
    return ReferenceDraft(score_list, token_list, parents_list, tree)
