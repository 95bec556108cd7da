"""MTP drafter: the checkpoint's own MTP block drafts trees EAGLE-2 style.

Step 0 runs the root row (pending token + the target's streams at P-1) and keeps its topk
tokens; each later step runs the MTP block on the topk frontier nodes (tree-aware sliding
window over the draft layer's committed KV plus each node's ancestors, via the same verify
plan as the target), scores children by cumulative probability and keeps the best topk.
organize_draft_results + build_tree then give the verify tree. eagle_topk = 1 is the chain
MTP drafter. After every commit, `sync` extends the draft layer's KV over the accepted rows
(the draft-extend step) from the target's streams of those rows (Request.new_hidden)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention.backend import get_backend
from ..attention.layer import kv_rows
from ..attention.plan import build_plan
from ..cache.state import LayerCache, RequestCache
from ..errors import StateError
from ..model.forward import decoder_layer_rows, row_rope
from ..model.hf_bindings import apply_rotary_pos_emb
from ..model.mtp import MtpBlock, load_mtp
from ..tree.build import build_tree, organize_draft_results
from ..tree.convert import tensors_to_trees
from ..tree.draft_tree import DraftTree
from .base import TreeShape


@dataclass
class MtpState:
    cache: RequestCache  # draft layer rows for positions 0 .. seq_len-1
    prev_hidden: torch.Tensor  # [hc, hidden] target streams at position seq_len-1 (zeros at 0)


@dataclass
class MtpRows:
    logits: torch.Tensor  # [T, vocab]
    hidden: torch.Tensor  # [T, hc, hidden] MTP output streams (fed to child rows)
    raw: torch.Tensor  # [T, head_dim] the draft layer's K=V rows


class MtpDrafter:
    def __init__(self, model, shape: TreeShape, mtp: MtpBlock | None = None):
        self.model = model
        self.mtp = mtp if mtp is not None else load_mtp(model)
        self.shape = shape
        self.ops = get_backend("torch")
        self.states: dict = {}
        self.last_rows: MtpRows | None = None  # rows of the last draft (for inspection/tests)
        self.last_draft_tree: DraftTree | None = None

    # ------------------------------------------------------------ the MTP block over rows
    @torch.no_grad()
    def run(self, trees, caches, hidden_in: torch.Tensor) -> MtpRows:
        """MTP rows for draft trees over their draft-layer caches; hidden_in [T, hc, hidden]."""
        plan = build_plan(trees, [c.seq_len for c in caches], self.model.window, ()).to(self.model.device)
        ids = plan.input_ids.unsqueeze(0)
        emb = self.model.hf.model.embed_tokens(ids)
        x = self.mtp.inputs(emb[0], hidden_in)
        rope = row_rope(self.model, plan, emb)
        h, rows, _ = decoder_layer_rows(self.mtp.decoder, x, plan, [c.layers[0] for c in caches], rope, self.ops, ids)
        logits = self.model.hf.lm_head(self.mtp.norm(self.mtp.hc_head(h)))[0]
        return MtpRows(logits, h[0], rows.raw)

    # ------------------------------------------------------------ draft-extend
    def _state(self, req) -> MtpState:
        st = self.states.get(req.request_id)
        if st is None:
            d = self.model.config.head_dim
            cache = RequestCache(0, [LayerCache(torch.empty(0, d, dtype=self.model.dtype, device=self.model.device))])
            hc, hidden = self.model.config.hc_mult, self.model.config.hidden_size
            st = MtpState(cache, torch.zeros(hc, hidden, dtype=self.model.dtype, device=self.model.device))
            self.states[req.request_id] = st
        return st

    @torch.no_grad()
    def sync(self, req) -> None:
        """Extend the draft layer's cache over rows the target committed since the last sync.

        A row's K=V depends only on its own input, and the layer keeps a sliding window, so
        only the last `window` new rows are computed (from the last window + 1 target streams)."""
        st = self._state(req)
        new = req.seq_len - st.cache.seq_len
        if new == 0:
            return
        w = self.model.window
        need = min(new, w + 1)
        if req.new_hidden is None or req.new_hidden.shape[0] < need or new < 0:
            have = None if req.new_hidden is None else req.new_hidden.shape[0]
            raise StateError(f"MTP drafter is {new} rows behind request {req.request_id} but the request carries "
                             f"hidden states for {have}; call draft() after every prefill and commit")
        first = max(st.cache.seq_len, req.seq_len - w)  # first row to compute
        streams = req.new_hidden[-need:]  # positions seq_len - need .. seq_len - 1
        base = req.seq_len - need
        prev = [st.prev_hidden.unsqueeze(0)] if first == st.cache.seq_len else []
        hid = torch.cat(prev + [streams[max(0, first - 1 - base) : need - 1]])
        positions = torch.arange(first, req.seq_len, device=self.model.device)
        ids = req.tokens[first : req.seq_len].to(self.model.device)
        emb = self.model.hf.model.embed_tokens(ids.unsqueeze(0))
        _, _, collapsed = self.mtp.decoder.attn_hc(self.mtp.inputs(emb[0], hid))
        cos, sin = self.model.hf.model.rotary_emb(emb, position_ids=positions.unsqueeze(0), layer_type="main")
        attn = self.mtp.decoder.self_attn
        raw = kv_rows(attn, self.mtp.decoder.input_layernorm(collapsed), cos, sin, apply_rotary_pos_emb)
        st.cache.layers[0].window = torch.cat([st.cache.layers[0].window, raw])[-w:].clone()
        st.cache.seq_len = req.seq_len
        st.prev_hidden = streams[-1].clone()

    # ------------------------------------------------------------ EAGLE-2 expansion
    @torch.no_grad()
    def draft_one(self, req) -> DraftTree:
        k, steps, n = self.shape.topk, self.shape.num_steps, self.shape.num_draft_tokens
        st = self._state(req)
        toks, parents, hid = [req.root_token], [-1], [st.prev_hidden]

        def forward():
            tree = DraftTree(torch.tensor(toks, dtype=torch.int64), torch.tensor(parents, dtype=torch.int64))
            return self.run([tree], [st.cache], torch.stack(hid))

        rows = forward()
        probs = torch.softmax(rows.logits[0].float(), -1)
        p0, t0 = probs.topk(k)
        score_list, token_list = [p0.view(1, 1, k).cpu()], [t0.view(1, k).cpu()]
        parents_list = [torch.tensor([[-1] + list(range(k))])]
        # frontier: (token, cumulative score, parent MTP row)
        frontier = [(int(t0[j]), float(p0[j]), 0) for j in range(k)]
        for step in range(1, steps):
            first = len(toks)
            for tok, _, prow in frontier:
                toks.append(tok)
                parents.append(prow)
                hid.append(rows.hidden[prow])
            rows = forward()
            fr_rows = torch.arange(first, first + k)
            pc, tc = torch.softmax(rows.logits[fr_rows].float(), -1).topk(k, dim=-1)  # [k, k]
            scores = torch.tensor([f[1] for f in frontier]).unsqueeze(1) * pc.cpu()
            score_list.append(scores.view(1, k, k))
            token_list.append(tc.cpu().reshape(1, k * k))
            flat = scores.reshape(-1)
            chosen = torch.sort(flat, descending=True, stable=True).indices[:k]
            parents_list.append((chosen + k * k * (step - 1) + k).view(1, k))
            frontier = [(int(tc.reshape(-1)[c]), float(flat[c]), first + int(c) // k) for c in chosen]
        self.last_rows = rows
        self.last_draft_tree = DraftTree(torch.tensor(toks, dtype=torch.int64), torch.tensor(parents, dtype=torch.int64))
        org = organize_draft_results(score_list, token_list, parents_list, n)
        built = build_tree(torch.tensor([req.root_token]), org.parent_list, org.top_scores_index, org.draft_tokens,
                           torch.tensor([req.seq_len]), k, steps, n)
        return tensors_to_trees(built.draft_tokens, built.retrieve_next_token, built.retrieve_next_sibling)[0]

    def draft(self, engine, requests) -> list:
        out = []
        for req in requests:
            self.sync(req)
            out.append(self.draft_one(req))
        return out
