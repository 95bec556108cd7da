"""Sampled DSpark drafts captured per batch bucket (drafters/dspark_graphs.drawn_draft).

* the drawn draft's device half (fixed size, and the chain budget priced by a cost table with
  its siblings) reads nothing from the host and runs on the meta device as a capture would;
* the uniforms come from the run's generator before the replay (draw_uniforms), depth-major as
  the walk takes them: one call draws what depth-by-depth calls would;
* at a full bucket the captured draft is the eager drafter's draft bit for bit, round after
  round: trees, draw rows, the budget and its table choice, the history the budget keeps and the
  sibling rates' pending trees, so sampled outputs (the same generator) are the eager ones;
* generate_batch samples through it at any batch and replays every round; with a padding request
  in the bucket (its spine zeroed before the budget) the sampled tokens are still the eager
  drafter's; on a CUDA device (DSV4_TREE_GPU=1, scripts/gpu_check) a real CUDA graph gives them too."""
from __future__ import annotations

import pytest
import torch

import dsv4_tree as dt
from dsv4_tree.diagnostics import HostReadCounter, forbid_host_sync
from dsv4_tree.drafters.base import TreeShape
from dsv4_tree.budget.cost_table import LineTable
from dsv4_tree.drafters.dspark import DSparkDrafter
from dsv4_tree.drafters.dspark_cache import pack_contexts
from dsv4_tree.drafters.dspark_drawn import draw_uniforms
from dsv4_tree.drafters.dspark_graphs import table_seconds
from dsv4_tree.drafters.dspark_replay import replay_form
from dsv4_tree.drafters.dspark_spine_graphs import drawn_draft
from dsv4_tree.executor.graphs import cuda_capture, eager_capture
from dsv4_tree.train.corpus import heldout_prompt
from test_dspark_graphs import CountingCapture, _inputs, budget_state, rehearse_on_meta, replay_keys

TABLE = LineTable((1, 16), (0.01, 0.012), (0.0004, 0.0003), note="a fixed price list for the test")
SHAPE = TreeShape(3, 4, 9)  # spine 4 deep, siblings 2 + 2 at the first two depths
RATES = torch.tensor([0.3, 0.15], dtype=torch.float64)


@pytest.fixture(scope="module")
def trained():
    return dt.load_model(dt.trained_checkpoint())


def _engine(model, adaptive: bool, max_requests: int = 8):
    return dt.Engine(model, dt.SpecConfig(eagle_topk=SHAPE.topk, num_steps=SHAPE.num_steps,
                                          num_draft_tokens=SHAPE.num_draft_tokens, accept="sampling",
                                          draft_depth="adaptive" if adaptive else "fixed",
                                          max_requests=max_requests))


def test_one_draw_of_all_depths_is_the_depth_by_depth_draws():
    g = torch.Generator().manual_seed(5)
    steps = [torch.rand(7, generator=g, dtype=torch.float64) for _ in range(4)]
    u = draw_uniforms(torch.Generator().manual_seed(5), 7, 4, "cpu")
    assert u.shape == (7, 4) and u.is_contiguous()
    assert torch.equal(u, torch.stack(steps, 1))


@pytest.mark.parametrize("adaptive", [False, True])
def test_the_drawn_device_draft_reads_nothing_and_runs_on_meta(adaptive):
    model = dt.load_model(dt.trained_checkpoint())  # its own: moved to the meta device below
    model.hf.set_experts_implementation("batched_mm")  # the meta device's grouped GEMM takes bf16 only
    drafter = DSparkDrafter(model, SHAPE, cost_table=TABLE)
    module, depth = drafter.module, drafter.spine_depth
    reqs, contexts = _inputs(model, module, [20, 70, 9])
    tables, lengths = pack_contexts(contexts, model.window)
    args = (torch.tensor([r.root_token for r in reqs]), torch.tensor([r.seq_len for r in reqs]), tables,
            torch.tensor(lengths), draw_uniforms(torch.Generator().manual_seed(0), 3, depth, "cpu"))
    if adaptive:
        lagged = torch.tensor([[0.9, 0.8, 0.7, 0.6], [1.0, 1.0, 1.0, 1.0], [0.5, 0.2, 0.9, 0.9]])
        args += (torch.tensor(3), table_seconds(TABLE, 3, 3 * depth), lagged, RATES)

    def run(*a):
        return drawn_draft(model, module, SHAPE, None, model.window, 1.0, 0.9, adaptive, *a)

    with torch.inference_mode(), forbid_host_sync(), HostReadCounter() as reads:
        out = run(*args)
    assert reads.total == 0, dict(reads.by_reason)
    n, vocab = SHAPE.num_draft_tokens, model.vocab_size
    assert tuple(out.batch.tokens.shape) == (3, n) and tuple(out.rows.shape) == (3, n - 1, vocab)
    assert torch.allclose(out.rows.sum(-1), torch.ones(3, n - 1, dtype=torch.float64))  # draw rows
    if adaptive:
        counts = out.batch.counts.tolist()
        assert all(1 <= c <= n for c in counts) and tuple(out.confidence.shape) == (3, depth)
        assert 0 <= int(out.unsettled[0]) <= 3 * depth
    model.hf.to("meta")
    module.to("meta")
    meta = rehearse_on_meta(run, *args)
    assert meta.batch.tokens.device.type == "meta" and meta.rows.shape == out.rows.shape


def _rounds(model, reqs_prompts, adaptive: bool, graphs, rounds: int = 3) -> list:
    """Three sampled rounds drafted by one drafter, verified, accepted and committed by hand:
    what each draft gave and what its policy held after it."""
    eng = _engine(model, adaptive)
    drafter = DSparkDrafter(model, SHAPE, cost_table=TABLE if adaptive else None, graphs=graphs)
    eng.register_drafter(drafter)
    gen = torch.Generator().manual_seed(3)
    drafter.set_sampling(1.0, 0.95, gen)
    reqs = eng.prefill_batch(reqs_prompts)
    seen, got = replay_keys(drafter) if graphs else [], []
    for _ in range(rounds):
        trees = drafter.draft(eng, reqs)
        got.append(([t.host_lists() for t in trees], [t.draft_probs.tolist() for t in trees], budget_state(drafter, reqs),
                    [(s, t.host_lists()) for s, t in (drafter.sibling_rate._pending or {}).values()]))
        out = eng.verify(reqs, trees)
        eng.commit(reqs, eng.accept_sampling(reqs, trees, out, 1.0, 0.95, gen), out)
        drafter.end_round(reqs)
    return got, seen


@pytest.mark.parametrize("adaptive", [False, True])
def test_a_captured_drawn_draft_is_the_eager_one_at_a_full_bucket(trained, adaptive):
    prompts = [heldout_prompt(64, 40 + s) for s in range(4)]  # 4 requests fill their bucket
    eager, none = _rounds(trained, prompts, adaptive, False)
    captured, keys = _rounds(trained, prompts, adaptive, eager_capture)
    assert not none and keys == [("drawn", adaptive, 1.0, 0.95)] * 3, keys
    assert captured == eager
    if adaptive:  # a real choice: some rounds cut a spine or keep a sibling, not all or nothing
        nodes = [len(t[0]) for rnd in eager for t in rnd[0]]
        assert min(nodes) < SHAPE.num_draft_tokens and max(nodes) > 1, nodes


@pytest.mark.parametrize("adaptive", [False, True])
def test_a_captured_drawn_drafter_samples_what_the_eager_one_samples(trained, adaptive, device):
    """3 requests in a bucket of 4, then fewer as they finish: the padding request's spine is
    zeroed before the budget, so the real requests' trees, budgets and draws are the eager
    drafter's and, with the same generator, so is every sampled token."""
    model = trained if device.type == "cpu" else dt.load_model(dt.trained_checkpoint(), device=device)
    prompts = [heldout_prompt(64, 60 + s) for s in range(3)]
    runs = {}
    forms = [("eager", False), ("eager stand-in", eager_capture)] + ([("captured", True)] if device.type == "cuda" else [])
    for name, graphs in forms:
        capture = CountingCapture(graphs if callable(graphs) else cuda_capture) if graphs else False
        drafter = DSparkDrafter(model, SHAPE, cost_table=TABLE if adaptive else None, graphs=capture)
        seen = replay_keys(drafter) if graphs else []
        outs = _engine(model, adaptive).generate_batch(prompts, 24, drafter=drafter, temperature=1.0,
                                                       generator=torch.Generator(device=device).manual_seed(7),
                                                       progress=False)
        if graphs:
            rounds = max(o.stats.rounds for o in outs)
            assert len(seen) == rounds and set(seen) == {("drawn", adaptive, 1.0, 1.0)}, seen  # every round replayed
            assert capture.captures == len({k[0] for k in drafter.graphs.graphs}) <= 3  # buckets 4, 2, 1
        assert any(a > 1 for o in outs for a in o.stats.accept_lengths)  # drafts were accepted
        runs[name] = [(o.tokens, o.stats.accept_lengths, o.stats.round_nodes) for o in outs]
    assert all(r == runs["eager"] for r in runs.values()), {k: r[0][1] for k, r in runs.items()}


def test_what_stays_eager_under_sampling(trained):
    eng = _engine(trained, True)
    drafter = DSparkDrafter(trained, SHAPE, graphs=eager_capture, size="adaptive")
    drafter.set_sampling(1.0)
    assert replay_form(drafter, eng, "fixed", 3) == "drawn"
    assert replay_form(drafter, eng, "adaptive", 3) is None  # no cost table: lines learnt online
    drafter.set_cost_table(TABLE)
    assert replay_form(drafter, eng, "adaptive", 3) == "drawn budget"
    drafter.policy.forced_nodes = 4.0
    assert replay_form(drafter, eng, "adaptive", 3) is None  # forced: profile_costs' measurement
    base = DSparkDrafter(trained, SHAPE, graphs=eager_capture, branching="base")
    base.set_sampling(1.0)
    assert replay_form(base, eng, "fixed", 3) is None  # refused by the eager draft, by name
