"""A DSpark draft's device half at a fixed shape, and its capture per batch bucket
(drafters/dspark_graphs.py).

* the padded backbone pass (contexts padded to the window, padded_block_index) lists exactly the
  keys of the packed one and computes the same block;
* fixed_draft reads nothing from the host (forbid_host_sync, HostReadCounter) and runs on the
  meta device as a capture would, after a warm-up: no host read, no host tensor meeting a
  device one, no copy to the device (rehearse_on_meta);
* the drafter's graphs (executor/graphs.BucketGraphs) capture once per bucket and its replays equal fixed_draft run eagerly on the
  bucket's padded inputs, round after round; the drafter drafts through it in generate_batch,
  whose greedy output stays Hugging Face's;
* the budgeted tree (budget_draft, a cost table) reads nothing either, and at a full bucket its
  replay is the eager drafter's budget_trees bit for bit (trees, budget, table choice, valued
  pool), with the prior and with a fitted value model.

The capture is executor/graphs.py's contract: on CPU its eager stand-in (replay reruns the draft
into the static outputs), on a CUDA device (DSV4_TREE_GPU=1, scripts/gpu_check) a real CUDA
graph, where the replay must equal the eager stand-in's result bit for bit (both run the same
kernels at the same shapes)."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import dsv4_tree as dt
from dsv4_tree.diagnostics import HostReadCounter, forbid_host_sync
from dsv4_tree.drafters.base import TreeShape
from dsv4_tree.drafters.dspark import DSparkDrafter
from dsv4_tree.budget.cost_table import LineTable
from dsv4_tree.drafters.dspark_cache import DSparkContext, bring_up, pack_contexts
from dsv4_tree.drafters.dspark_graphs import budget_draft, fixed_draft, padded_block, replay_fixed, table_seconds
from dsv4_tree.drafters.dspark_replay import replay_form
from dsv4_tree.drafters.dspark_rows import block_ids, block_rows, padded_block_index
from dsv4_tree.budget.node_values import ValueModel
from dsv4_tree.errors import ConfigError
from dsv4_tree.executor.graphs import cuda_capture, eager_capture
from dsv4_tree.train.corpus import heldout_prompt
from test_device import NoHostTensorsInDeviceOps


class NoCopiesToTheDevice(TorchDispatchMode):
    """Fails a host-to-device copy: a CUDA graph cannot capture one (a pageable copy is refused
    during capture, and a replay would not repeat what the host held)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket)
        if name == "aten.copy_":
            src, dst = args[1], args[0].device
        elif name in ("aten._to_copy", "aten.to"):
            src, dst = args[0], kwargs.get("device")
        else:
            src = dst = None
        if isinstance(src, torch.Tensor) and src.device.type == "cpu" and dst is not None and torch.device(dst).type != "cpu":
            raise AssertionError(f"{func}: a host-to-device copy of shape {tuple(src.shape)} inside a captured function")
        return func(*args, **kwargs)


def rehearse_on_meta(fn, *inputs):
    """fn(*inputs moved to the meta device) as a capture runs it: once to warm up (caches made
    per device), then again where a host read, a host tensor meeting a device one, or a copy to
    the device fails."""
    meta = tuple(x.to("meta") for x in inputs)
    with torch.inference_mode():
        fn(*meta)
        with forbid_host_sync(), NoHostTensorsInDeviceOps(), NoCopiesToTheDevice():
            return fn(*meta)


SHAPES = {"chain": TreeShape(1, 5, 6), "tree": TreeShape(4, 5, 8)}
# fp32 packed vs padded: the same keys, the padded rows' logits at -inf (exact zeros); only the
# reductions' blocking over a wider row differs, a few ulps per layer through two stages
REL_TOL = 1e-5


@pytest.fixture(scope="module")
def trained():
    return dt.load_model(dt.trained_checkpoint())


def _engine(model, shape: TreeShape, **spec):
    return dt.Engine(model, dt.SpecConfig(eagle_topk=shape.topk, num_steps=shape.num_steps,
                                          num_draft_tokens=shape.num_draft_tokens, draft_depth="fixed",
                                          max_requests=8, **spec))


def _inputs(model, module, lengths_of_prompts: list):
    """Prefilled requests with their DSpark contexts brought up -> (requests, contexts)."""
    eng = _engine(model, SHAPES["chain"])
    eng.register_drafter(DSparkDrafter(model, SHAPES["chain"], module=module))
    reqs = eng.prefill_batch([heldout_prompt(n, 50 + i) for i, n in enumerate(lengths_of_prompts)])
    contexts = [DSparkContext.empty(model, module) for _ in reqs]
    bring_up(model, module, contexts, reqs)
    return reqs, contexts


def _packed_index(lengths: list, gamma: int) -> torch.Tensor:
    """The contexts back to back (no padding), then the B * gamma block rows: each block row's keys,
    its request's context rows and its own block's rows. -> [B * gamma, max(lengths) + gamma], -1 = none."""
    width, total = max(lengths), sum(lengths)
    rows = []
    for b, n in enumerate(lengths):
        start = sum(lengths[:b])
        keys = [start + j for j in range(n)] + [-1] * (width - n) + [total + b * gamma + i for i in range(gamma)]
        rows += [keys] * gamma
    return torch.tensor(rows)


def test_the_padded_block_lists_the_packed_keys_and_computes_the_same_block(trained):
    model = trained
    module = DSparkDrafter(model, SHAPES["chain"]).module
    w, rows = model.window, module.settings.block_rows
    reqs, contexts = _inputs(model, module, [5, 40, 130])  # short, mid, past the window
    contexts.insert(1, DSparkContext.empty(model, module))  # a request with no context yet
    reqs.insert(1, reqs[0])
    lengths = [c.tables.shape[1] for c in contexts]
    assert lengths[0] < lengths[2] < lengths[3] == w and lengths[1] == 0
    packed_index = _packed_index(lengths, rows)
    tables, got = pack_contexts(contexts, w)
    assert got == lengths and tuple(tables.shape) == (module.settings.num_stages, len(lengths) * w, model.config.head_dim)
    index = padded_block_index(torch.tensor(lengths), rows, w)
    assert tuple(index.shape) == (len(lengths) * rows, w + rows)
    # the same keys, as table rows: padded id -> (request, row) -> packed id
    offsets = [sum(lengths[:b]) for b in range(len(lengths))]
    b_total = len(lengths)

    def as_packed(i: int) -> int:
        if i < 0:
            return -1
        if i >= b_total * w:  # a block row
            return sum(lengths) + (i - b_total * w)
        b, j = divmod(i, w)
        assert j < lengths[b], f"padded index {i} lists an empty slot of request {b}"
        return offsets[b] + j

    for r in range(index.shape[0]):
        want = sorted(x for x in packed_index[r].tolist() if x >= 0)
        assert sorted(as_packed(x) for x in index[r].tolist() if x >= 0) == want, f"block row {r}"
    anchors = torch.tensor([17, 0, 101, 33])
    starts = torch.tensor([r.seq_len for r in reqs])
    with torch.inference_mode():
        packed = block_rows(model, module, block_ids(module, anchors), starts,
                            torch.cat([c.tables for c in contexts], 1), packed_index)
        padded = padded_block(model, module, anchors, starts, tables, torch.tensor(lengths), w)
    for name in ("base", "hidden"):
        a, b = getattr(packed, name), getattr(padded, name)
        err = float(((a - b).abs() / a.abs().amax(-1, keepdim=True)).max())
        assert err <= REL_TOL, f"{name}: padded differs from packed by {err:.2e}"


@pytest.mark.parametrize("kind", sorted(SHAPES))
def test_the_device_draft_reads_nothing_and_runs_on_meta(kind):
    model = dt.load_model(dt.trained_checkpoint())  # its own: moved to the meta device below
    model.hf.set_experts_implementation("batched_mm")  # the meta device's grouped GEMM takes bf16 only
    shape = SHAPES[kind]
    module = DSparkDrafter(model, shape).module
    reqs, contexts = _inputs(model, module, [20, 70, 9])
    tables, lengths = pack_contexts(contexts, model.window)
    args = (torch.tensor([r.root_token for r in reqs]), torch.tensor([r.seq_len for r in reqs]), tables,
            torch.tensor(lengths))
    with torch.inference_mode(), forbid_host_sync(), HostReadCounter() as reads:
        batch = fixed_draft(model, module, shape, "markov", None, model.window, *args)
    assert reads.total == 0, dict(reads.by_reason)
    assert tuple(batch.tokens.shape) == (3, shape.num_draft_tokens) == tuple(batch.parents.shape)
    assert batch.tokens.is_contiguous() and batch.parents.is_contiguous()  # a graph's static outputs own memory
    assert [t.tokens.tolist()[0] for t in batch.trees()] == [r.root_token for r in reqs]
    # the meta device: shapes only
    model.hf.to("meta")
    module.to("meta")
    meta = rehearse_on_meta(lambda *a: fixed_draft(model, module, shape, "markov", None, model.window, *a), *args)
    assert meta.tokens.device.type == "meta" and tuple(meta.tokens.shape) == tuple(batch.tokens.shape)


def replay_keys(drafter) -> list:
    """The keys of the drafter's graph replays from now on, in a list that grows as they run."""
    keys, real = [], drafter.graphs.run
    drafter.graphs.run = lambda *a, **k: keys.append(k["key"]) or real(*a, **k)
    return keys


def budget_state(drafter, reqs) -> tuple:
    """What a drafter's budget holds after a draft (request ids differ by engine: its history by request)."""
    p = drafter.policy
    return None if p is None else (p.last_budget, p.last_choice, p.kind,
                                   [[r.tolist() for r in p._history[q.request_id]] for q in reqs])


class CountingCapture:
    """executor/graphs.py's capture contract, counting captures (eager on CPU, CUDA on a GPU)."""

    def __init__(self, inner):
        self.inner, self.captures = inner, 0

    def __call__(self, fn):
        self.captures += 1
        return self.inner(fn)


@pytest.mark.parametrize("kind", sorted(SHAPES))
def test_replays_equal_the_eager_draft_at_the_bucket(trained, kind, device):
    model = trained if device.type == "cpu" else dt.load_model(dt.trained_checkpoint(), device=device)
    shape = SHAPES[kind]
    capture = CountingCapture(cuda_capture if device.type == "cuda" else eager_capture)
    drafter = DSparkDrafter(model, shape, graphs=capture)
    drafter.graphs.max_graphs = 2
    module, w = drafter.module, model.window
    reqs, contexts = _inputs(model, module, [20, 70, 9, 33, 50])
    for rnd, pick in enumerate(([0, 1, 2], [3, 1, 0, 4], [2], [4, 3, 2, 1, 0], [1, 2, 3])):
        ctx = [contexts[i] for i in pick]
        tables, lengths = pack_contexts(ctx, w)
        anchors = torch.tensor([(reqs[i].root_token + 7 * rnd) % model.vocab_size for i in pick], device=model.device)
        starts = torch.tensor([reqs[i].seq_len for i in pick], device=model.device)
        lengths = torch.tensor(lengths, device=model.device)
        got = replay_fixed(drafter, [reqs[i] for i in pick], anchors, starts, tables, lengths)
        # eager, at the bucket's shape: the same requests, then padding requests with no context
        bp = 1 << (len(pick) - 1).bit_length()
        pad = bp - len(pick)
        with torch.inference_mode():
            want = fixed_draft(model, module, shape, "markov", None, w,
                               torch.cat([anchors, anchors.new_zeros(pad)]), torch.cat([starts, starts.new_zeros(pad)]),
                               torch.cat([tables, tables.new_zeros(tables.shape[0], pad * w, tables.shape[2])], 1),
                               torch.cat([lengths, lengths.new_zeros(pad)]))
        assert [t.host_lists() for t in got] == [(want.tokens[b].tolist(), want.parents[b].tolist())
                                                 for b in range(len(pick))], f"round {rnd}: replayed trees differ"
    # buckets 4, 4, 1, 8, 4 with two graphs held: 4 captured, 1, 8 (4 dropped), 4 again
    assert capture.captures == 4 and sorted(drafter.graphs.graphs) == [(4, "fixed"), (8, "fixed")]


@pytest.mark.parametrize("kind", sorted(SHAPES))
def test_a_captured_drafter_drafts_as_the_eager_one_and_generates_hugging_faces_output(trained, kind, device):
    model = trained if device.type == "cpu" else dt.load_model(dt.trained_checkpoint(), device=device)
    shape = SHAPES[kind]
    prompts = [heldout_prompt(64, 10 + s) for s in range(3)]
    runs = {}
    for name, graphs in (("eager stand-in", eager_capture), ("captured", device.type == "cuda" or eager_capture)):
        eng = _engine(model, shape)
        drafter = DSparkDrafter(model, shape, graphs=graphs)
        seen = []
        real = drafter.graphs.run
        drafter.graphs.run = lambda *a, **k: seen.append(1) or real(*a, **k)
        outs = eng.generate_batch(prompts, 16, drafter=drafter, progress=False)
        rounds = max(o.stats.rounds for o in outs)
        assert len(seen) == rounds, f"{name}: {len(seen)} replays in {rounds} rounds"  # every round replayed
        assert (4, "fixed") in drafter.graphs.graphs and {k[0] for k in drafter.graphs.graphs} <= {1, 2, 4}, \
            sorted(drafter.graphs.graphs)
        runs[name] = [(o.tokens, o.stats.accept_lengths) for o in outs]
    assert runs["captured"] == runs["eager stand-in"]
    hf = dt.load_model(dt.trained_checkpoint()).hf
    for p, (tokens, _) in zip(prompts, runs["captured"]):
        assert tokens == hf.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False)[0, len(p):].tolist()


def test_graphs_are_refused_by_name_where_they_cannot_run(trained):
    with pytest.raises(ConfigError, match="graphs=True captures drafts in CUDA graphs; the model is on cpu"):
        DSparkDrafter(trained, SHAPES["chain"], graphs=True)
    with pytest.raises(ConfigError, match="graphs must be True, False or a capture function, got 'yes'"):
        DSparkDrafter(trained, SHAPES["chain"], graphs="yes")
    # captured drafts are unrecorded, fixed-size or priced by a cost table: the others run eagerly
    shape = SHAPES["tree"]
    eng = _engine(model := trained, shape)
    drafter = DSparkDrafter(model, shape, graphs=eager_capture, record=True)
    assert not replay_form(drafter, eng, "fixed", 3)
    drafter = DSparkDrafter(model, shape, graphs=eager_capture)
    assert replay_form(drafter, eng, "fixed", 8) and not replay_form(drafter, eng, "fixed", 9)  # max_requests 8
    assert not replay_form(drafter, eng, "adaptive", 3)
    drafter.set_sampling(1.0)
    assert replay_form(drafter, eng, "fixed", 3) == "drawn"  # sampled: the uniforms are an input
    assert not replay_form(drafter, eng, "adaptive", 3)  # no cost table: a budget learnt online
    assert not replay_form(drafter, _engine(model, shape, cuda_graph_max_bs=2), "fixed", 3)
    eng.model.ranks = object()  # a sharded model (stands in for a process group): eager drafts
    try:
        assert not replay_form(drafter, eng, "fixed", 3)
    finally:
        eng.model.ranks = None


TABLE = LineTable((1, 16), (0.01, 0.012), (0.0004, 0.0003), note="a fixed price list for the test")
BUDGETED = TreeShape(4, 5, 16)
FITTED = ValueModel((0.2, 1.1, 0.7, 0.3, 0.4))


def _budget_engine(model):
    return dt.Engine(model, dt.SpecConfig(eagle_topk=4, num_steps=5, num_draft_tokens=16, draft_depth="adaptive",
                                          max_requests=8))


def _budget_inputs(model, drafter, reqs, contexts, fitted: bool):
    """budget_draft's inputs for these requests at their own batch size (no padding)."""
    tables, lengths = pack_contexts(contexts, model.window)
    b = len(reqs)
    pool = BUDGETED.topk + (BUDGETED.num_steps - 1) * BUDGETED.topk ** 2
    weights = torch.tensor(FITTED.weights if fitted else [0.0] * 5, dtype=torch.float64)
    return (torch.tensor([r.root_token for r in reqs]), torch.tensor([r.seq_len for r in reqs]), tables,
            torch.tensor(lengths), torch.tensor(b), table_seconds(TABLE, b, b * pool), weights)


@pytest.mark.parametrize("fitted", [False, True])
def test_the_budgeted_device_draft_reads_nothing_and_runs_on_meta(fitted):
    model = dt.load_model(dt.trained_checkpoint())  # its own: moved to the meta device below
    model.hf.set_experts_implementation("batched_mm")
    drafter = DSparkDrafter(model, BUDGETED, cost_table=TABLE)
    module = drafter.module
    reqs, contexts = _inputs(model, module, [20, 70, 9])
    args = _budget_inputs(model, drafter, reqs, contexts, fitted)

    def run(*a):
        return budget_draft(model, module, BUDGETED, "markov", None, model.window, BUDGETED.num_draft_tokens - 1,
                            fitted, *a)

    with torch.inference_mode(), forbid_host_sync(), HostReadCounter() as reads:
        out = run(*args)
    assert reads.total == 0, dict(reads.by_reason)
    counts = out.batch.counts.tolist()
    assert all(1 <= c <= BUDGETED.num_draft_tokens for c in counts) and int(out.unsettled[0]) == sum(counts) - 3
    model.hf.to("meta")
    module.to("meta")
    meta = rehearse_on_meta(run, *args)
    assert meta.batch.tokens.device.type == "meta" and meta.batch.tokens.shape == out.batch.tokens.shape


@pytest.mark.parametrize("fitted", [False, True])
def test_a_captured_budgeted_tree_is_the_eager_one_at_a_full_bucket(trained, fitted):
    """4 requests fill their bucket: the captured function runs budget_trees' shapes, so every
    round's trees, budget, cost-table choice and valued pool are the eager drafter's, bit for bit."""
    prompts = [heldout_prompt(64, 20 + s) for s in range(4)]
    got = {}
    for name, graphs in (("eager", False), ("captured", eager_capture)):
        eng = _budget_engine(trained)
        drafter = DSparkDrafter(trained, BUDGETED, cost_table=TABLE, graphs=graphs, values=FITTED if fitted else None)
        eng.register_drafter(drafter)
        if graphs:
            replays, real = [], drafter.graphs.run
            drafter.graphs.run = lambda *a, **k: replays.append(k["key"]) or real(*a, **k)
        pools, payload = [], drafter.values.payload
        drafter.values.payload = lambda tokens, pool: pools.append((tokens, pool)) or payload(tokens, pool)
        reqs = eng.prefill_batch(prompts)
        rounds = []
        for _ in range(3):
            trees = drafter.draft(eng, reqs)
            tokens, pool = pools[-1]
            rounds.append(([(t.tokens.tolist(), t.parents.tolist()) for t in trees], drafter.policy.last_budget,
                           drafter.policy.last_choice, tokens.tolist(), pool.values.tolist(), pool.parents.tolist(),
                           pool.features.tolist(), pool.depths.tolist()))
            out = eng.verify(reqs, trees)
            eng.commit(reqs, eng.accept_greedy(reqs, trees, out), out)
            drafter.end_round(reqs)
        got[name] = rounds
        if graphs:
            assert replays == [("budget", fitted)] * 3, replays
    assert got["captured"] == got["eager"]
    assert any(b not in (0, 4 * (BUDGETED.num_draft_tokens - 1)) for _, b, *_ in got["eager"])  # a real choice


def test_a_captured_budgeted_drafter_generates_hugging_faces_output(trained, device):
    model = trained if device.type == "cpu" else dt.load_model(dt.trained_checkpoint(), device=device)
    prompts = [heldout_prompt(64, 30 + s) for s in range(3)]  # a bucket of 4, one padding request
    eng = _budget_engine(model)
    drafter = DSparkDrafter(model, BUDGETED, cost_table=TABLE, graphs=device.type == "cuda" or eager_capture)
    seen, real = [], drafter.graphs.run
    drafter.graphs.run = lambda *a, **k: seen.append(k["key"]) or real(*a, **k)
    outs = eng.generate_batch(prompts, 16, drafter=drafter, progress=False)
    rounds = max(o.stats.rounds for o in outs)
    assert len(seen) == rounds and set(seen) == {("budget", False)}, seen  # every round replayed, the prior
    assert (4, "budget", False) in drafter.graphs.graphs
    assert any(n > 1 for o in outs for n in o.stats.round_nodes)
    hf = dt.load_model(dt.trained_checkpoint()).hf
    for p, o in zip(prompts, outs):
        assert o.tokens == hf.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False)[0, len(p):].tolist()
