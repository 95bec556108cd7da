"""The MTP drafter's EAGLE-2 wave after its root step, one step at a time, and the same wave at
a fixed shape for capture.

`Wave` holds what the steps s >= 1 carry: the K=V table (the requests' windows, then every
step's rows), the frontier (its tokens, scores, rows and ancestors' table ids) and
organize_draft_results' lists. `step` runs one draft-layer pass over the batch's B x topk
frontier rows, given their window keys; the drafter's eager loop (drafters/mtp.py) decides
between steps (adaptive depth), the captured form runs them all.

`fixed_wave` is the wave of a fixed depth from tensors alone: the root rows' logits, streams and
K=V, the roots and their positions, every request's window padded to `window` rows and the
windows' lengths; its window keys are built on the device (`padded_window_index`), so every
shape depends only on (B, window, the tree shape) and nothing is read on the host: what the
drafter captures per batch bucket (executor/graphs.BucketGraphs, `MtpDrafter(graphs=...)`)."""
from __future__ import annotations

import torch

from ..tree.build import local_parents, organize_draft_results
from ..tree.tree_batch import TreeBatch
from .mtp_rows import MtpRows, draft_rows


def padded_window_index(lengths: torch.Tensor, depth: int, rows_per_request: int, window: int) -> torch.Tensor:
    """mtp_cache.window_index for windows padded to `window` rows each (request b's at table rows
    b * window ..), on lengths' device -> [B * rows_per_request, window] ids, -1 = not visible."""
    b, dev = lengths.shape[0], lengths.device
    j = torch.arange(window, device=dev)
    lo = (lengths + depth - window + 1).unsqueeze(1)  # first visible j
    ok = (j < lengths.unsqueeze(1)) & (j >= lo)
    idx = torch.where(ok, torch.arange(b, device=dev).unsqueeze(1) * window + j, -1)  # [B, window]
    return idx.unsqueeze(1).expand(b, rows_per_request, window).reshape(b * rows_per_request, window)


class Wave:
    """The expansion's state after step 0 (rows0: the B root rows)."""

    def __init__(self, rows0: MtpRows, roots: torch.Tensor, seq: torch.Tensor, window_table: torch.Tensor, topk: int):
        b, k, dev = roots.shape[0], topk, roots.device
        self.b, self.k, self.seq = b, k, seq
        m = window_table.shape[0]
        self.table = torch.cat([window_table, rows0.raw])
        self.rows = rows0
        self.fscore, self.ftok = torch.softmax(rows0.logits.float(), -1).topk(k, dim=-1)  # [B, K]
        self.score_list, self.token_list = [self.fscore.view(b, 1, k)], [self.ftok]
        self.parents_list = [torch.arange(-1, k, device=dev).expand(b, k + 1)]
        self.src = torch.arange(b, device=dev).unsqueeze(1).expand(b, k)  # frontier's parent row in `rows`
        self.anc = (m + self.src).unsqueeze(2)  # [B, K, s] table ids of each frontier row's ancestors
        self.fparent = torch.zeros(b, k, dtype=torch.int64, device=dev)  # frontier's parent, record numbering
        self.rec_parents = [torch.full((b, 1), -1, dtype=torch.int64, device=dev)]
        self.steps_rows, self.step_ids = [rows0], [roots]
        self.flat = self.pc = None  # the last step's candidate scores [B, K*K] and child probabilities [T, K]

    def step(self, model, mtp, s: int, window_keys: torch.Tensor) -> None:
        """Step s >= 1 over the frontier; window_keys [B * K, W'] its rows' window ids in the table."""
        b, k, dev = self.b, self.k, self.ftok.device
        t, m, w = b * k, self.table.shape[0], model.window
        a = self.anc.reshape(t, s)
        if s >= w:  # ancestors that fell out of the window
            a = torch.where(torch.arange(s, device=dev) > s - w, a, torch.full_like(a, -1))
        index = torch.cat([window_keys, a, (m + torch.arange(t, device=dev)).unsqueeze(1)], 1)
        positions = (self.seq + s).unsqueeze(1).expand(b, k).reshape(t)
        rows = draft_rows(model, mtp, self.ftok.reshape(t), self.rows.hidden[self.src.reshape(t)], positions,
                          self.table, index)
        self.steps_rows.append(rows)
        self.step_ids.append(self.ftok.reshape(t))
        self.rec_parents.append(self.fparent)
        self.table = torch.cat([self.table, rows.raw])
        pc, tc = torch.softmax(rows.logits.float(), -1).topk(k, dim=-1)  # [T, K]
        scores = self.fscore.unsqueeze(2) * pc.view(b, k, k)
        flat, tflat = scores.view(b, k * k), tc.view(b, k * k)
        self.score_list.append(scores)
        self.token_list.append(tflat)
        chosen = torch.sort(flat, dim=1, descending=True, stable=True).indices[:, :k]
        self.parents_list.append(chosen + k * k * (s - 1) + k)
        sel = torch.arange(b, device=dev).unsqueeze(1) * k + chosen // k  # [B, K] rows of this step
        self.fscore, self.ftok = flat.gather(1, chosen), tflat.gather(1, chosen)
        self.anc = torch.cat([a[sel.reshape(-1)].view(b, k, s), (m + sel).unsqueeze(2)], 2)
        self.src, self.rows = sel, rows
        self.fparent = 1 + (s - 1) * k + chosen // k
        self.flat, self.pc = flat, pc

    def pick(self, roots: torch.Tensor, num_draft_tokens: int) -> tuple:
        """-> (TreeBatch of every request's tree, organize_draft_results' pick)."""
        pool = sum(x[0].numel() for x in self.score_list)
        org = organize_draft_results(self.score_list, self.token_list, self.parents_list, min(num_draft_tokens, pool + 1))
        # the trees build_tree's tensors describe (tests/test_mtp_incremental.py checks the two
        # agree), straight from the selection: SGLang's masks and links are not needed here
        parents = local_parents(org.parent_list, org.top_scores_index, self.k, check=False)
        return TreeBatch(torch.cat([roots.unsqueeze(1), org.draft_tokens], 1), parents), org


def fixed_wave(model, mtp, shape, logits0: torch.Tensor, hidden0: torch.Tensor, raw0: torch.Tensor,
               roots: torch.Tensor, seq: torch.Tensor, windows: torch.Tensor, lengths: torch.Tensor) -> tuple:
    """The whole wave of shape.num_steps steps from its input tensors (module docstring); windows
    [B * W, head_dim] padded to the model's window W, lengths [B] -> (TreeBatch, score_list,
    token_list, parents_list), each tensor its own memory (a graph's static outputs)."""
    wave = Wave(MtpRows(logits0, hidden0, raw0), roots, seq, windows, shape.topk)
    for s in range(1, shape.num_steps):
        wave.step(model, mtp, s, padded_window_index(lengths, s, shape.topk, model.window))
    batch, _ = wave.pick(roots, shape.num_draft_tokens)
    own = lambda xs: [x.contiguous() for x in xs]  # noqa: E731
    return (batch.contiguous(), own(wave.score_list),
            own(wave.token_list), own(wave.parents_list))
