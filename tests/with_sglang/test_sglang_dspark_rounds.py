"""Whole DSpark tree rounds (draft, verify, accept, commit, next draft) through the plug-in's
tree decode step (`DSparkTreeStep.run`, what replaces `DSparkWorkerV2._forward_decode`) on the
shipped tiny checkpoint, for a batch of two requests: every round's tree, accepted tokens and
committed draft context equal the engine's (`Engine` + `DSparkDrafter`, fixed-size trees, run in
the project's main environment by dspark_oracle.py), the draft context each round commits equals
what SGLang's own chain commit writes for a chain of the accepted path, and the tokens equal
`Engine.generate(drafter="dspark", eagle_topk=4)`'s and Hugging Face's greedy ones.
What runs as SGLang runs it and what is substituted: sgl_dspark.py."""
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.speculative.dspark_components.dspark_draft import make_next_draft_input

from dsv4_tree.sglang_plugin.dspark_runtime import DSparkTreeSpec
from dsv4_tree.sglang_plugin.dspark_step import DSparkTreeStep
from dsv4_tree.sglang_plugin.scratch import ensure_scratch
from plugin_probe import dsv4_dir
from sgl_cases import layout
from sgl_dspark import (RecordedDraft, RecordedVerify, greedy_sampling_info, recorded_worker, sglang_markov_head,
                        use_plugin_commit_hooks, use_triton_tree_kernels, use_triton_window_kernel)
from sgl_pool import make_pool, published_context

ROOT = Path(__file__).resolve().parents[2]
N, ROUNDS, NEW, LENGTHS = 8, 5, 24, (40, 23)


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    """The engine's rounds, recorded in the main environment (built by scripts/env.sh if missing)."""
    out = tmp_path_factory.mktemp("oracle") / "trace.pt"
    cmd = (f"source scripts/env.sh >&2 && python tests/with_sglang/dspark_oracle.py {out} {N} {ROUNDS} {NEW} "
           + " ".join(map(str, LENGTHS)))
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME")}
    run = subprocess.run(["bash", "-c", cmd], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stderr[-3000:]
    return torch.load(out)


def test_rounds_through_the_tree_step_equal_the_engine(trace, tmp_path, monkeypatch):
    from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator
    from sglang.srt.runtime_context import get_parallel

    gamma, bs = trace["gamma"], len(LENGTHS)
    lens = [p["seq_len"] for p in trace["prefill"]]
    req_to_token, mapping = layout(lens, N, torch.Generator().manual_seed(0), max_len=512)
    rows = req_to_token.shape[0]
    use_triton_tree_kernels(monkeypatch)
    use_triton_window_kernel(monkeypatch)
    use_plugin_commit_hooks(monkeypatch)
    with published_context(dsv4_dir(str(tmp_path)), N), get_parallel().override(tp_group=None):
        target_pool = make_pool(rows * 2 + 1, rows, mapping)
        ensure_scratch(target_pool, N)
        draft_pool = make_pool(rows * 2 + 1, rows, mapping, ratios=(0,))
        translator = KVIndexTranslator(req_to_token=req_to_token, token_to_kv_pool_allocator=SimpleNamespace(),
                                       token_to_kv_pool=target_pool, page_size=256, device="cpu")
        draft = RecordedDraft(sglang_markov_head(trace["markov_w1"], trace["markov_w2"], monkeypatch), gamma)
        verify = RecordedVerify(N)
        worker = recorded_worker(draft, verify, gamma=gamma, n=N, target_pool=target_pool, draft_pool=draft_pool,
                                 translator=translator)
        step = DSparkTreeStep(worker, DSparkTreeSpec(trace["topk"], gamma, N))
        rpi = torch.arange(1, bs + 1, dtype=torch.int64)
        seq = torch.tensor(lens, dtype=torch.int64)
        batch = SimpleNamespace(req_pool_indices=rpi, forward_mode=ForwardMode.DECODE, has_grammar=False,
                                return_logprob=False, sampling_info=greedy_sampling_info(bs), device="cpu",
                                out_cache_loc=None, top_logprobs_nums=[0] * bs, token_ids_logprobs=[None] * bs,
                                spec_info=make_next_draft_input(bonus_tokens=torch.tensor([p["root"] for p in trace["prefill"]]),
                                                                new_seq_lens=seq))
        emitted = [[] for _ in range(bs)]
        for r, round_ in enumerate(trace["rounds"]):
            draft.round = verify.round = round_
            batch.seq_lens, batch.seq_lens_cpu, batch.seq_lens_sum = seq, seq.clone(), int(seq.sum())
            batch.return_logprob = r == 2  # SGLang's tree logprobs in one round
            published = []
            result = step.run(batch, published.append)
            paths = [x["path"] for x in round_]
            want_lens = torch.tensor([len(p) for p in paths], dtype=torch.int32)
            assert torch.equal(result.accept_lens.cpu(), want_lens), (r, result.accept_lens, want_lens)
            assert torch.equal(result.new_seq_lens, seq + want_lens) and torch.equal(published[0], result.new_seq_lens)
            out = result.next_token_ids.view(bs, N)
            for b, x in enumerate(round_):
                toks = [int(x["tokens"][i]) for i in x["path"][1:]] + [x["bonus"]]
                assert out[b, :len(toks)].tolist() == toks, (r, b)
                emitted[b] += toks
            assert result.next_draft_input.bonus_tokens.tolist() == [x["bonus"] for x in round_]
            if batch.return_logprob:
                lp = result.logits_output.next_token_logprobs
                for b, x in enumerate(round_):
                    logp = torch.log_softmax(x["logits"][x["path"]].float(), -1)
                    toks = out[b, :len(x["path"])].long()
                    assert torch.allclose(lp[b, :len(x["path"])], logp.gather(1, toks.view(-1, 1)).view(-1)), (r, b)
            check_context_commit(draft, worker, round_, req_to_token, rpi, draft_pool, seq, r)
            seq = result.new_seq_lens.clone()
            batch.spec_info = result.next_draft_input
            batch.forward_mode = ForwardMode.DECODE
    for b in range(bs):
        got = emitted[b][:NEW]
        assert got == trace["hf_greedy"][b][:len(got)] == trace["generate"][b][:len(got)], b
    assert sum(len(e) for e in emitted) > ROUNDS * bs  # trees accepted more than the bonus


def check_context_commit(draft, worker, round_, req_to_token, rpi, draft_pool, seq, r) -> None:
    """The round's draft-context write: the accepted nodes' target features at positions P + depth
    (the engine's committed rows), exactly what SGLang's chain commit writes for a chain whose
    first accept_len columns are the accepted path."""
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput

    hidden, swa_loc, positions = draft.writes[-1]
    bs = len(round_)
    lens = torch.tensor([len(x["path"]) for x in round_])
    for b, x in enumerate(round_):
        rows = slice(b * N, (b + 1) * N)
        length, p = len(x["path"]), x["seq_len"]
        assert torch.equal(positions[rows], p + torch.arange(N)), (r, b)
        slots = req_to_token[int(rpi[b]), p:p + N].to(torch.int64)
        want = torch.where(torch.arange(N) < length, draft_pool.translate_loc_from_full_to_swa(slots).to(torch.int32),
                           torch.full((N,), -1, dtype=torch.int32))
        assert torch.equal(swa_loc[rows], want), (r, b)
        assert torch.equal(hidden[rows][:length], x["committed_features"][-length:]), (r, b)  # the engine's rows
    chain = torch.zeros(bs * N, round_[0]["features"].shape[1])
    for b, x in enumerate(round_):
        chain[b * N:b * N + len(x["path"])] = x["features"][x["path"]]
    window = SimpleNamespace(positions_2d=seq.view(-1, 1) + torch.arange(N), verify_cache_loc_2d=torch.stack(
        [req_to_token[int(rid), int(p):int(p) + N] for rid, p in zip(rpi, seq)]).to(torch.int64))
    window.kv_loc_plan = SimpleNamespace(write_ids=lambda translator, cols=None: window.verify_cache_loc_2d.view(-1))
    worker._verify_executor.commit_hidden(
        batch=SimpleNamespace(req_pool_indices=rpi), layout=None, hidden_strided=None, verify_window=window,
        logits_output=LogitsProcessorOutput(next_token_logits=None, hidden_states=chain),
        commit_lens=lens.to(torch.int32), bs=bs, run_compact=False)
    chain_hidden, chain_loc, chain_pos = draft.writes[-1]
    assert torch.equal(chain_loc, swa_loc) and torch.equal(chain_pos, positions), r
    kept = swa_loc >= 0
    assert torch.equal(chain_hidden[kept], hidden[kept]), r
