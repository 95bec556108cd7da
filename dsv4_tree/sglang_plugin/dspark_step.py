"""The DSpark tree decode step: what replaces `DSparkWorkerV2._forward_decode` when the published
spec is a DSpark tree (`dspark_worker.py` installs it). One round for the running batch:

1. the verify window (SGLang's `alloc_verify_window`: N slots per request, positions P + j);
2. the draft block: SGLang's own backbone pass (`DraftBlockProposer._run_forward`, the draft runner
   with its own DeepSeek-V4 backend and CUDA graphs) and base logits (`compute_base_logits`);
3. the Markov tree (`dspark_tree_inputs.draft_tree`: the engine's rule over SGLang's heads) and its
   verify input (SGLang's tree builder; node i in window slot i, position P + depth(i));
4. the target verify: SGLang's verify forward (`TargetVerifyExecutor._forward_prepared_verify`:
   `prepare_for_verify`, graph replay or eager metadata) through the plug-in's tree backend;
5. acceptance: SGLang's tree acceptance (`eagle_sample`: greedy, or its lossless tree sampling
   against the target), logprobs from SGLang's tree form (`compute_spec_logprobs(accept_index=)`);
6. the target commit: SGLang's C128 cleanup call and `_finalize_accept_tree_path` (both hooked by
   the plug-in: its commit transaction), which also moves the accepted nodes' predictions and
   verify features to the front of each request's window;
7. the draft-context commit: SGLang's chain commit (`commit_hidden`) over that compacted window:
   column j < accept_len now holds the accepted depth-j node's features, committed at position
   P + j = P + depth, exactly what SGLang's chain commit writes for a chain whose first accept_len
   columns are the accepted path.
The result has SGLang's DSpark layout: tokens [bs * N] (the first accept_len of each row valid),
accept lengths (drafts + bonus), the bonus as the next anchor."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ConfigError, StateError
from .dspark_heads import SGLangMarkovHeads
from .dspark_runtime import DSparkTreeSpec
from .dspark_tree_inputs import draft_tree, tree_verify_input


@dataclass(frozen=True)
class DraftBlock:
    base: torch.Tensor  # [bs, gamma, vocab] U_1..U_gamma over the whole vocabulary
    hidden: torch.Tensor  # [bs, gamma, d] the hc-collapsed rows
    anchors: torch.Tensor  # [bs] the roots' tokens (the last round's bonus)


def check_worker(worker, tree: DSparkTreeSpec) -> None:
    """Refuse, by name, a DSpark worker the tree step cannot serve (at construction)."""
    problems = []
    if worker.gamma != tree.gamma or worker.verify_num_draft_tokens != tree.num_draft_tokens:
        problems.append(f"the worker resolved gamma={worker.gamma}, verify width {worker.verify_num_draft_tokens}; "
                        f"the tree needs gamma={tree.gamma}, {tree.num_draft_tokens}")
    if not worker.sample_from_anchor:
        problems.append("the draft checkpoint sets sample_from_anchor=false (its block has gamma + 1 query rows; "
                        "the tree step drafts from SGLang's default anchor row)")
    if not worker._draft_is_moe:
        problems.append("the draft is not a DeepSeek-V4 DSpark module")
    if worker._verify_epilogue is not None or worker._sampling_accept_graph is not None:
        problems.append("an in-graph verify epilogue / sampling-accept graph is built (chain-only)")
    runner = worker.model_runner
    if getattr(getattr(runner, "ngram_embedding_manager", None), "enabled", False):
        problems.append("engram (the target's n-gram embedding history) is enabled")
    if getattr(runner, "watermark_state", None) is not None:
        problems.append("watermarking is enabled")
    if problems:
        raise ConfigError("dsv4_tree DSPARK tree: " + "; ".join(problems))


class DSparkTreeStep:
    """The tree decode step of one DSparkWorkerV2 (the draft-hosting PP stage)."""

    def __init__(self, worker, tree: DSparkTreeSpec):
        check_worker(worker, tree)
        self.worker = worker
        self.tree = tree
        self.heads = SGLangMarkovHeads(worker.draft_model)

    def run(self, batch, on_publish, grammar_barrier=None, coordination_plan=None):
        from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2
        from sglang.srt.speculative.dspark_components.dspark_planner import alloc_verify_window

        w, tree = self.worker, self.tree
        if coordination_plan is not None:
            raise StateError("dsv4_tree DSPARK tree: a DP prefill-coordination plan reached the tree step "
                             "(DP attention is refused with DSpark trees)")
        if getattr(w, "_need_mamba_verify_commit", False):
            raise ConfigError("dsv4_tree DSPARK tree: the target's mamba state commit is chain-only")
        if batch.spec_info is None:
            batch.spec_info = DFlashDraftInputV2.create_idle_input(device=w.device)
        draft_input = batch.spec_info
        if batch.forward_mode.is_idle():
            return w._decode_idle_result(on_publish=on_publish)
        if batch.has_grammar:
            raise StateError("dsv4_tree DSPARK tree: a batch with grammar-guided requests reached the tree step "
                             "(grammar.py finishes them at admission; was the plug-in loaded in the scheduler?)")
        if batch.seq_lens.is_cuda:
            batch.seq_lens.record_stream(torch.cuda.current_stream())
        bs = len(batch.seq_lens)
        window = alloc_verify_window(
            batch=batch, bs=bs, device=w.device, verify_num_draft_tokens=tree.num_draft_tokens,
            block_pos_offsets=w._block_pos_offsets, model_runner=w.model_runner,
            seq_lens_cpu=batch.seq_lens_cpu if batch.seq_lens_cpu is not None else draft_input.nxt_kv_lens_cpu)
        with w._draft_context():
            block = self.draft_block(batch, draft_input, window, bs)
        verify_input = self.verify_input(batch, block, window)
        logits_output, can_run_cuda_graph = self.target_verify(batch, verify_input)
        predict, accept_lens, accept_index = self.accept(batch, verify_input, logits_output)
        predict = self.commit(batch, accept_index, accept_lens, predict, logits_output, bs)
        new_seq_lens = batch.seq_lens + accept_lens
        if on_publish is not None:
            on_publish(new_seq_lens)
        self.commit_draft_context(batch, window, logits_output, accept_lens, bs)
        logits_output.hidden_states = None
        return self.result(logits_output, predict, accept_lens, new_seq_lens, can_run_cuda_graph, bs)

    def draft_block(self, batch, draft_input, window, bs: int) -> DraftBlock:
        """SGLang's backbone pass over every request's block [anchor, noise x (gamma - 1)] and its
        base logits, as SGLang's proposer runs them (its embedding choice, its draft runner)."""
        from sglang.srt.lora.layers import unwrap_lora_layer

        w = self.worker
        proposer, draft_model = w._proposer, w.draft_model
        target_model = w.target_worker.model_runner.model
        embed = unwrap_lora_layer(draft_model.embed_tokens if not proposer.sample_from_anchor
                                  else target_model.get_input_embeddings())
        fwd = proposer._run_forward(batch=batch, draft_input=draft_input, verify_window=window, bs=bs,
                                    device=w.device, embed_module=embed, draft_sampler=None, sampling_info=None)
        with proposer._base_logits_context():
            base, hidden = draft_model.compute_base_logits(fwd.raw_hidden)
        base = self.heads.full_vocab(base).view(bs, self.tree.gamma, -1)
        return DraftBlock(base, hidden.view(bs, self.tree.gamma, -1), fwd.draft_block_ids[:, 0])

    def verify_input(self, batch, block: DraftBlock, window):
        tree = self.tree
        drafted = draft_tree(self.heads, block.base, block.hidden, block.anchors, tree.topk, tree.num_draft_tokens)
        return tree_verify_input(drafted, block.anchors, batch.seq_lens, tree.topk, tree.gamma,
                                 tree.num_draft_tokens, kv_loc_plan=window.kv_loc_plan,
                                 live_seq_lens_cpu=batch.seq_lens_cpu)

    def target_verify(self, batch, verify_input):
        """SGLang's DSpark verify forward (the tree backend builds the tree rows' metadata from the
        verify input's links, eagerly or in the graph's out-of-graph prep)."""
        batch.out_cache_loc = verify_input.kv_loc_plan.write_virtual
        result = self.worker._verify_executor._forward_prepared_verify(
            batch=batch, verify_input=verify_input, seq_lens_cpu_backup=batch.seq_lens_cpu,
            seq_lens_sum_backup=batch.seq_lens_sum)
        return result.logits_output, result.can_run_cuda_graph

    @staticmethod
    def accept(batch, verify_input, logits_output):
        """SGLang's tree acceptance -> (predict [bs * N] int32, accept_lens [bs] int32 (drafts +
        bonus), accept_index [bs, gamma + 1] int32 global node ids, -1 padded)."""
        from sglang.srt.layers.logprob_processor import compute_spec_logprobs
        from sglang.srt.speculative.eagle_utils import eagle_sample

        predict, accept_lens, accept_index = eagle_sample(verify_input, batch, logits_output)
        if batch.return_logprob:
            compute_spec_logprobs(batch, logits_output, predict, accept_index=accept_index)
        return predict, accept_lens, accept_index

    def commit(self, batch, accept_index, accept_lens, predict, logits_output, bs: int):
        """SGLang's tree commit calls (the plug-in's hooks make them its commit transaction) ->
        predict with each request's accepted path at the front of its window."""
        from sglang.srt.speculative.eagle_worker_common import _finalize_accept_tree_path

        n = self.tree.num_draft_tokens
        allocator = self.worker.model_runner.token_to_kv_pool_allocator
        allocator.get_kvcache().clear_unaccepted_c128_draft_states(batch.req_pool_indices, batch.seq_lens,
                                                                   accept_lens, n)
        return _finalize_accept_tree_path(batch, accept_index, accept_lens, predict, logits_output, bs,
                                          token_to_kv_pool_allocator=allocator, num_draft_tokens=n)

    def commit_draft_context(self, batch, window, logits_output, accept_lens, bs: int) -> None:
        """SGLang's chain commit of the draft context over the compacted window: column j < accept_len
        is the accepted depth-j node (its verify row's features), at position P + j."""
        self.worker._verify_executor.commit_hidden(
            batch=batch, layout=None, hidden_strided=None, verify_window=window, logits_output=logits_output,
            commit_lens=accept_lens, bs=bs, run_compact=False)

    def result(self, logits_output, predict, accept_lens, new_seq_lens, can_run_cuda_graph, bs: int):
        from sglang.srt.managers.scheduler import GenerationBatchResult
        from sglang.srt.speculative.dspark_components.dspark_draft import make_next_draft_input

        n = self.tree.num_draft_tokens
        bonus = predict.view(bs, n).gather(1, (accept_lens.long() - 1).view(-1, 1)).view(-1).to(torch.int64)
        return GenerationBatchResult(
            logits_output=logits_output, next_token_ids=predict, accept_lens=accept_lens,
            block_accept_lens=accept_lens, can_run_cuda_graph=can_run_cuda_graph,
            next_draft_input=make_next_draft_input(bonus_tokens=bonus, new_seq_lens=new_seq_lens),
            speculative_num_draft_tokens=n, new_seq_lens=new_seq_lens)
