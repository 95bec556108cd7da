"""A DSpark tree's verify inputs: the Markov expansion over one draft block (the engine's rule,
`drafters/dspark_tree.py`), SGLang's `organize_draft_results` (the best N - 1 candidates by path
probability) and SGLang's tree builder (`build_tree_kernel_efficient`: node order, positions
P + depth, first-child / next-sibling links), carried to the target verify by a DFlash verify
input that also holds the tree (`DSparkTreeVerifyInput`): the tree backend's metadata reads the
links from it, SGLang's tree acceptance (`eagle_sample`) reads the tree fields EAGLE's verify
input has."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
from sglang.srt.speculative.dflash_info import DFlashVerifyInput


@dataclass
class DSparkTreeVerifyInput(DFlashVerifyInput):
    """SGLang's DFlash verify input (draft_token: the nodes' tokens [bs * N] in node order,
    positions: P + depth [bs * N]) with the tree."""
    retrieve_index: Optional[torch.Tensor] = None  # [bs, N] int64 global node ids
    retrieve_next_token: Optional[torch.Tensor] = None  # [bs, N] int64 first child, -1 none
    retrieve_next_sibling: Optional[torch.Tensor] = None  # [bs, N] int64 next sibling, -1 none
    spec_steps: int = 0  # the tree's depth (gamma)
    draft_probs: Optional[torch.Tensor] = None  # none: the tree is drawn by top-K, not sampled

    @property
    def max_tree_depth(self) -> int:
        return self.spec_steps + 1

    @property
    def tree_topk(self) -> int:
        return self.topk


@dataclass(frozen=True)
class DraftedTree:
    """organize_draft_results' output for B requests."""
    parent_list: torch.Tensor  # [B, K + 1 + (gamma - 2) K] candidate parents (global ids)
    top_scores_index: torch.Tensor  # [B, N - 1] chosen candidate ids, ascending
    draft_tokens: torch.Tensor  # [B, N - 1] their tokens


def draft_tree(heads, base: torch.Tensor, hidden: torch.Tensor, anchors: torch.Tensor, topk: int,
               num_draft_tokens: int) -> DraftedTree:
    """base [B, gamma, vocab] U_1..U_gamma, hidden [B, gamma, d] (shape only here), anchors [B] the
    roots' tokens -> the best N - 1 candidates of the depth-gamma Markov expansion."""
    from sglang.srt.speculative.eagle_utils import organize_draft_results

    from ..drafters.dspark_rows import DSparkBlock
    from ..drafters.dspark_tree import expand_markov

    gamma = base.shape[1]
    exp = expand_markov(heads, DSparkBlock(base, hidden), anchors.long(), topk, gamma, "markov")
    parent_list, top_scores_index, draft_tokens = organize_draft_results(
        exp.score_list, exp.token_list, exp.parents_list, num_draft_tokens)
    return DraftedTree(parent_list, top_scores_index, draft_tokens)


def tree_verify_input(drafted: DraftedTree, anchors: torch.Tensor, seq_lens: torch.Tensor, topk: int, gamma: int,
                      num_draft_tokens: int, kv_loc_plan=None, live_seq_lens_cpu=None) -> DSparkTreeVerifyInput:
    """The verify input of the drafted trees at committed lengths seq_lens [B] (SGLang's tree
    builder; the mask is QLEN_ONLY, which the DeepSeek-V4 backends never read)."""
    from sglang.kernels.ops.speculative.spec_tree import TreeMaskMode
    from sglang.srt.speculative.eagle_utils import build_tree_kernel_efficient

    _, positions, retrieve_index, next_token, next_sibling, tokens = build_tree_kernel_efficient(
        anchors.long(), drafted.parent_list, drafted.top_scores_index, drafted.draft_tokens, seq_lens,
        0, topk, gamma, num_draft_tokens, tree_mask_mode=TreeMaskMode.QLEN_ONLY)  # the sum sizes a FULL_MASK only
    return DSparkTreeVerifyInput(
        draft_token=tokens, positions=positions, draft_token_num=num_draft_tokens, topk=topk, custom_mask=None,
        capture_hidden_mode=CaptureHiddenMode.FULL, live_seq_lens_cpu=live_seq_lens_cpu, kv_loc_plan=kv_loc_plan,
        retrieve_index=retrieve_index, retrieve_next_token=next_token, retrieve_next_sibling=next_sibling,
        spec_steps=gamma)
