"""Stand-ins for the parts of SGLang's DSpark worker that need a GPU model, for running the DSpark
tree decode step (`dsv4_tree.sglang_plugin.dspark_step.DSparkTreeStep.run`) on the CPU.

What runs as in SGLang: the step itself, SGLang's `alloc_verify_window` (a real `KVIndexTranslator`),
its tree builder and tree acceptance (`eagle_sample`), the plug-in's commit transaction around
SGLang's `_finalize_accept_tree_path` on a real `DeepSeekV4TokenToKVPool`, SGLang's draft-context
commit (`TargetVerifyExecutor.commit_hidden` through a real `TargetHiddenKvInjector` over a real
draft pool), SGLang's V4 Markov head (`DSparkV4MarkovHead`, W2 in fp32 as the tiny checkpoint
stores it: SGLANG_DSPARK_OPT_MARKOV_W2_BF16=0). What is substituted, by name:
* the draft runner's backbone pass and head (`DraftBlockProposer._run_forward`,
  `compute_base_logits`): the engine's recorded DSpark backbone pass of that round
  (`RecordedDraft`), after checking the step's draft inputs (anchor, positions);
* the target forward (`TargetVerifyExecutor._forward_prepared_verify`): the engine's recorded
  exact tree verify of that round (logits and target features per node), after checking the
  step's verify input is the engine's tree (`RecordedVerify`);
* the DSpark draft model's context-KV write (`write_target_hidden_kv`): recorded (`ContextWrites`);
* SGLang's CUDA tree kernels: its own Triton versions (`sgl_build_tree_kernel_triton`,
  `verify_tree_greedy_triton`, the ones it runs on XPU), under the Triton interpreter; its verify
  window gather (`assign_extend_cache_locs_uniform`) likewise."""
from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.speculative.dspark_components.dspark_draft import DraftForwardResult
from sglang.srt.speculative.dspark_components.dspark_kv_inject import TargetHiddenKvInjector
from sglang.srt.speculative.dspark_components.dspark_verify import TargetVerifyExecutor, TargetVerifyResult

from dsv4_tree.sglang_plugin.tables import depths, parents_from_retrieve

NOISE = 258  # the shipped DSpark's noise token


def sglang_markov_head(w1: torch.Tensor, w2: torch.Tensor, monkeypatch):
    from sglang.srt.models.deepseek_v4_dspark import DSparkV4MarkovHead

    monkeypatch.setenv("SGLANG_DSPARK_OPT_MARKOV_W2_BF16", "0")
    head = DSparkV4MarkovHead(vocab_size=w1.shape[0], markov_rank=w1.shape[1])
    with torch.no_grad():
        head.markov_w1.weight[:w1.shape[0]].copy_(w1)  # the embedding pads its rows to 64 (SGLang's loader fills the first)
        head.markov_w2.weight.copy_(w2)
    return head


def use_triton_tree_kernels(monkeypatch) -> None:
    from sglang.kernels.ops.speculative.spec_tree import sgl_build_tree_kernel_triton, verify_tree_greedy_triton
    from sglang.srt.speculative import eagle_utils

    def greedy(*, topk=-1, **kw):
        verify_tree_greedy_triton(**kw)
        return kw["predicts"], kw["accept_index"], kw["accept_token_num"]

    monkeypatch.setattr(eagle_utils, "build_tree_kernel_efficient_func", sgl_build_tree_kernel_triton)
    monkeypatch.setattr(eagle_utils, "verify_tree_greedy_func", greedy)


def use_triton_window_kernel(monkeypatch) -> None:
    """SGLang's verify-window gather (`assign_extend_cache_locs_uniform_func`) takes its Triton kernel
    on CUDA / HIP / MUSA / XPU and a CPU `sgl_kernel` op elsewhere (not installed here): the Triton
    branch, as on XPU, under the interpreter."""
    from sglang.kernels.ops.speculative import cache_locs

    monkeypatch.setattr(cache_locs, "_is_xpu", True)


def use_plugin_commit_hooks(monkeypatch) -> None:
    """The plug-in's AROUND hooks on SGLang's commit calls, as its HookRegistry installs them."""
    import functools

    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool
    from sglang.srt.speculative import eagle_worker_common as ewc

    from dsv4_tree.sglang_plugin import hooks
    from dsv4_tree.sglang_plugin.commit import move_kv_cache

    monkeypatch.setattr(DeepSeekV4TokenToKVPool, "move_kv_cache", move_kv_cache, raising=False)  # register() sets it
    clear = DeepSeekV4TokenToKVPool.clear_unaccepted_c128_draft_states
    monkeypatch.setattr(DeepSeekV4TokenToKVPool, "clear_unaccepted_c128_draft_states",
                        lambda pool, *a, **k: hooks.around_clear_unaccepted_c128_draft_states(clear, pool, *a, **k))
    monkeypatch.setattr(ewc, "_finalize_accept_tree_path",
                        functools.partial(hooks.around_finalize_accept_tree_path, ewc._finalize_accept_tree_path))


class RecordedDraft:
    """The draft runner's proposer and model for one recorded round (see the module docstring)."""
    sample_from_anchor = True
    embed_tokens = None

    def __init__(self, markov_head, gamma: int):
        self.markov_head = markov_head
        self.gamma = gamma
        self.round = None  # [per request] dicts of the engine's trace
        self.writes = []  # write_target_hidden_kv calls

    def _run_forward(self, *, batch, draft_input, verify_window, bs, device, embed_module, draft_sampler=None,
                     sampling_info=None, anchor_prepared=False):
        anchors = torch.tensor([r["anchor"] for r in self.round])
        starts = torch.tensor([r["seq_len"] for r in self.round])
        assert torch.equal(draft_input.bonus_tokens.view(-1).cpu(), anchors), "the step drafts from the last bonus"
        assert torch.equal(verify_window.positions_2d[:, :self.gamma].cpu(),
                           starts.view(-1, 1) + torch.arange(self.gamma)), "block positions P .. P + gamma - 1"
        ids = torch.cat([anchors.view(-1, 1), torch.full((bs, self.gamma - 1), NOISE)], 1)
        hidden = torch.stack([r["hidden"] for r in self.round])
        return DraftForwardResult(draft_block_ids=ids, raw_hidden=hidden.reshape(bs * self.gamma, -1),
                                  draft_hidden_3d=hidden, can_run_graph=False)

    @staticmethod
    @contextlib.contextmanager
    def _base_logits_context():
        yield

    def compute_base_logits(self, raw_hidden):
        base = torch.stack([r["base"] for r in self.round])
        assert torch.equal(raw_hidden, torch.stack([r["hidden"] for r in self.round]).reshape(raw_hidden.shape))
        return base.reshape(raw_hidden.shape[0], -1), raw_hidden

    def write_target_hidden_kv(self, *, main_hidden, swa_loc, positions, pool):
        self.writes.append((main_hidden.clone(), swa_loc.clone(), positions.clone()))


class RecordedVerify:
    """The target forward of one recorded round: checks the step's verify input is the engine's
    tree, sets it as the batch's spec_info (SGLang's prepare_for_verify does), returns the
    engine's logits and target features per node."""

    def __init__(self, n: int):
        self.n = n
        self.round = None

    def __call__(self, *, batch, verify_input, seq_lens_cpu_backup, seq_lens_sum_backup):
        bs, n = len(self.round), self.n
        tokens = torch.stack([r["tokens"] for r in self.round])
        parents = torch.stack([r["parents"] for r in self.round])
        starts = torch.tensor([r["seq_len"] for r in self.round]).view(-1, 1)
        assert torch.equal(verify_input.draft_token.view(bs, n).cpu(), tokens), "the engine's tree tokens"
        tree_parents = parents_from_retrieve(verify_input.retrieve_next_token, verify_input.retrieve_next_sibling)
        assert torch.equal(tree_parents.cpu(), parents), "the engine's tree shape"
        assert torch.equal(verify_input.positions.view(bs, n).cpu(), starts + depths(parents)), "positions P + depth"
        assert torch.equal(batch.out_cache_loc, verify_input.kv_loc_plan.write_virtual), "the window's slots"
        batch.spec_info = verify_input
        out = LogitsProcessorOutput(next_token_logits=torch.cat([r["logits"] for r in self.round]).clone(),
                                    hidden_states=torch.cat([r["features"] for r in self.round]).clone())
        return TargetVerifyResult(logits_output=out, can_run_cuda_graph=False)


def greedy_sampling_info(bs: int):
    return SimpleNamespace(is_all_greedy=True, acc_additive_penalties=None, acc_scaling_penalties=None,
                           logit_bias=None, has_watermark_candidates=False, sampling_seed=None,
                           temperatures=torch.ones(bs, 1))


def recorded_worker(draft: RecordedDraft, verify: RecordedVerify, *, gamma: int, n: int, target_pool, draft_pool,
                    translator):
    """A DSparkWorkerV2 as the tree step reads it, with SGLang's own injector and verify executor."""
    device = "cpu"
    allocator = SimpleNamespace(get_kvcache=lambda: target_pool)
    model_runner = SimpleNamespace(device=device, kv_index_translator=translator, token_to_kv_pool_allocator=allocator,
                                   ngram_embedding_manager=SimpleNamespace(enabled=False), watermark_state=None)
    draft_runner = SimpleNamespace(token_to_kv_pool=draft_pool, kv_index_translator=translator)
    offsets = torch.arange(n, dtype=torch.int64)
    injector = TargetHiddenKvInjector(draft_model=draft, draft_model_runner=draft_runner, model_runner=model_runner,
                                      device=device, verify_num_draft_tokens=n, block_pos_offsets=offsets)
    target_worker = SimpleNamespace(model_runner=SimpleNamespace(
        model_config=SimpleNamespace(hf_text_config=SimpleNamespace(model_type="deepseek_v4")),
        model=SimpleNamespace(get_input_embeddings=lambda: None)))
    executor = TargetVerifyExecutor(target_worker=target_worker, gamma=gamma, verify_num_draft_tokens=n,
                                    model_runner=model_runner, kv_injector=injector, tp_sync=None)
    executor._forward_prepared_verify = verify
    return SimpleNamespace(
        device=device, gamma=gamma, verify_num_draft_tokens=n, sample_from_anchor=True, _draft_is_moe=True,
        _verify_epilogue=None, _sampling_accept_graph=None, _need_mamba_verify_commit=False,
        model_runner=model_runner, target_worker=target_worker, _block_pos_offsets=offsets,
        _draft_context=contextlib.nullcontext, _proposer=draft, draft_model=draft, _verify_executor=executor)
