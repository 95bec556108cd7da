"""The greedy budgeted DSpark chain captured per batch bucket (drafters/dspark_graphs.chain_budget_draft):
SGLang's confidence-scheduled chain lengths, priced by a cost table.

* its device half reads nothing from the host and runs on the meta device as a capture would;
* at a full bucket the replay is the eager drafter's adaptive_chains bit for bit, round after
  round: chains, budget, table choice and the confidences the budget keeps for later rounds;
* with a padding request in the bucket (its confidences zeroed before the lengths) generate_batch
  through replays gives the eager drafter's rounds and Hugging Face's greedy output; on a CUDA
  device (DSV4_TREE_GPU=1, scripts/gpu_check) a real CUDA graph gives them too."""
from __future__ import annotations

import pytest
import torch

import dsv4_tree as dt
from dsv4_tree.budget.cost_table import LineTable
from dsv4_tree.diagnostics import HostReadCounter, forbid_host_sync
from dsv4_tree.drafters.base import TreeShape
from dsv4_tree.drafters.dspark import DSparkDrafter
from dsv4_tree.drafters.dspark_cache import pack_contexts
from dsv4_tree.drafters.dspark_graphs import table_seconds
from dsv4_tree.drafters.dspark_replay import replay_form
from dsv4_tree.drafters.dspark_spine_graphs import chain_budget_draft
from dsv4_tree.executor.graphs import cuda_capture, eager_capture
from dsv4_tree.train.corpus import heldout_prompt
from test_dspark_graphs import CountingCapture, _inputs, budget_state, rehearse_on_meta, replay_keys

TABLE = LineTable((1, 16), (0.01, 0.012), (0.0004, 0.0003), note="a fixed price list for the test")
CHAIN = TreeShape(1, 5, 6)


@pytest.fixture(scope="module")
def trained():
    return dt.load_model(dt.trained_checkpoint())


def _engine(model):
    return dt.Engine(model, dt.SpecConfig(eagle_topk=1, num_steps=5, num_draft_tokens=6, draft_depth="adaptive",
                                          max_requests=8))


def test_the_budgeted_chain_device_draft_reads_nothing_and_runs_on_meta():
    model = dt.load_model(dt.trained_checkpoint())  # its own: moved to the meta device below
    model.hf.set_experts_implementation("batched_mm")  # the meta device's grouped GEMM takes bf16 only
    module = DSparkDrafter(model, CHAIN, cost_table=TABLE).module
    reqs, contexts = _inputs(model, module, [20, 70, 9])
    tables, lengths = pack_contexts(contexts, model.window)
    lagged = torch.tensor([[0.9, 0.8, 0.7, 0.6, 0.5], [1.0] * 5, [0.5, 0.2, 0.9, 0.9, 0.9]])
    args = (torch.tensor([r.root_token for r in reqs]), torch.tensor([r.seq_len for r in reqs]), tables,
            torch.tensor(lengths), torch.tensor(3), table_seconds(TABLE, 3, 3 * 5), lagged)

    def run(*a):
        return chain_budget_draft(model, module, None, model.window, *a)

    with torch.inference_mode(), forbid_host_sync(), HostReadCounter() as reads:
        out = run(*args)
    assert reads.total == 0, dict(reads.by_reason)
    counts = out.batch.counts.tolist()
    assert all(1 <= c <= 6 for c in counts) and int(out.unsettled[0]) <= 3 * 5 and out.rows is None
    assert [t.tokens.tolist()[0] for t in out.batch.trees()] == [r.root_token for r in reqs]
    model.hf.to("meta")
    module.to("meta")
    meta = rehearse_on_meta(run, *args)
    assert meta.batch.tokens.device.type == "meta" and meta.batch.tokens.shape == out.batch.tokens.shape


def _rounds(model, prompts, graphs, rounds: int = 3) -> tuple:
    eng = _engine(model)
    drafter = DSparkDrafter(model, CHAIN, cost_table=TABLE, graphs=graphs)
    eng.register_drafter(drafter)
    reqs = eng.prefill_batch(prompts)
    seen, got = replay_keys(drafter) if graphs else [], []
    for _ in range(rounds):
        trees = drafter.draft(eng, reqs)
        got.append(([t.host_lists() for t in trees], budget_state(drafter, reqs)))
        out = eng.verify(reqs, trees)
        eng.commit(reqs, eng.accept_greedy(reqs, trees, out), out)
        drafter.end_round(reqs)
    return got, seen


def test_a_captured_budgeted_chain_is_the_eager_one_at_a_full_bucket(trained):
    prompts = [heldout_prompt(64, 70 + s) for s in range(4)]  # 4 requests fill their bucket
    eager, none = _rounds(trained, prompts, False)
    captured, keys = _rounds(trained, prompts, eager_capture)
    assert not none and keys == [("chain budget",)] * 3, keys
    assert captured == eager
    lens = [len(t[0]) for rnd in eager for t in rnd[0]]
    assert min(lens) < 6 or eager[-1][1][0] < 4 * 5, lens  # the budget cut somewhere: a real choice


def test_a_captured_budgeted_chain_generates_the_eager_rounds_and_hugging_faces_output(trained, device):
    model = trained if device.type == "cpu" else dt.load_model(dt.trained_checkpoint(), device=device)
    prompts = [heldout_prompt(64, 80 + s) for s in range(3)]  # a bucket of 4, one padding request
    runs = {}
    forms = [("eager", False), ("eager stand-in", eager_capture)] + ([("captured", True)] if device.type == "cuda" else [])
    for name, graphs in forms:
        capture = CountingCapture(graphs if callable(graphs) else cuda_capture) if graphs else False
        drafter = DSparkDrafter(model, CHAIN, cost_table=TABLE, graphs=capture)
        seen = replay_keys(drafter) if graphs else []
        outs = _engine(model).generate_batch(prompts, 16, drafter=drafter, progress=False)
        if graphs:
            rounds = max(o.stats.rounds for o in outs)
            assert len(seen) == rounds and set(seen) == {("chain budget",)}, seen  # every round replayed
            assert capture.captures == len({k[0] for k in drafter.graphs.graphs}) <= 3  # buckets 4, 2, 1
        runs[name] = [(o.tokens, o.stats.accept_lengths, o.stats.round_nodes) for o in outs]
    assert all(r == runs["eager"] for r in runs.values()), {k: r[0][1] for k, r in runs.items()}
    assert any(n < 6 for _, _, nodes in runs["eager"] for n in nodes)  # some chains were cut
    hf = dt.load_model(dt.trained_checkpoint()).hf
    for p, (tokens, _, _) in zip(prompts, runs["eager"]):
        assert tokens == hf.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False)[0, len(p):].tolist()


def test_the_budgeted_chain_is_captured_only_when_priced(trained):
    eng = _engine(trained)
    drafter = DSparkDrafter(trained, CHAIN, graphs=eager_capture, size="adaptive")
    assert replay_form(drafter, eng, "adaptive", 3) is None  # no cost table: lines learnt online
    drafter.set_cost_table(TABLE)
    assert replay_form(drafter, eng, "adaptive", 3) == "chain budget"
    drafter.policy.forced_nodes = 3.0
    assert replay_form(drafter, eng, "adaptive", 3) is None
