"""Chain vs tree at equal verify budgets, batched generation, and Hugging Face `generate` as the
baseline, in one run on the shipped trained checkpoint (greedy, held-out stdlib prompts).

For each case: mean tokens per verify (accepted drafts + bonus), tokens per second (wall
time of whole generate calls: prefill + draft + verify + accept + commit) and its ratio to
Hugging Face `model.hf.generate` (greedy, its own cache) measured in the same process; every
case's output must equal Hugging Face's. Budgets: N verify rows per round (chain: N-1 draft
steps; trees: topk 2 / 4). generate_batch runs 1, 4 and 16 prompts at once (tokens per
verify there is per request; "verifies" counts verify calls, one per round for the batch).
Each case runs --repeats times (same output each time), the cases taking turns in every
repeat, and each case's fastest run is reported, HF's included. Human table first, one JSON
line last. --quick finishes in about 30 s on 2 cores.

Draft depth: the hand-tuned rows draft a fixed depth; the preset rows run SGLang's default tree
(topk 4, N 8, at most 5 steps) with the adaptive depth policy and with fixed depth 5
(--depth-sweep adds fixed depths 1 to 4; depth 1 holds only 5 nodes). Every row reports
the draft steps run per round (of those allowed) and the draft / verify milliseconds per round;
generate_batch runs the preset tree, adaptive.

--count-ops runs each single-request case once more under dsv4_tree.diagnostics.OpCounter and
adds aten ops per generated token: on a CPU at these sizes a step's time is mostly per-op
overhead, and an op count does not move with the machine's load, so it backs up a tokens/s
ratio measured on a busy machine (its run is not timed). An adaptive case's counted run
chooses its own depths (on a clock slowed by the counting), so its steps per round are
printed with the policy's state below the table.

--device / --dtype run the model elsewhere (e.g. `--device cuda --dtype bfloat16`: the
CUDA comparison, steps chosen reported); HF generate runs on the same device and dtype."""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from typing import NamedTuple

import torch

import dsv4_tree as dt
from dsv4_tree.diagnostics import OpCounter
from dsv4_tree.train.corpus import heldout_prompt

# N -> (steps of the topk-2 tree, steps of the topk-4 tree), fixed, tuned by hand. At N = 8 the
# topk-4 tree drafts 2 steps: they already offer 20 candidates for its 7 draft slots; a third
# step adds one more draft pass per round for +0.05 tokens per verify on the trained checkpoint
# (design_notes/mtp-drafter.md). The preset rows show the adaptive policy finding this itself.
TREE_STEPS = {4: (2, 2), 8: (4, 2), 16: (6, 5)}
PRESET = (4, 5, 8)  # configs/tree_topk4.toml: topk, num_steps, num_draft_tokens


class Run(NamedTuple):
    """One job's result: `tokens` must repeat exactly; the rest may vary with timing (adaptive)."""

    tokens: list  # per prompt, new tokens
    rounds: int  # verify rounds, summed over prompts (per request in a batch)
    calls: int  # verify calls
    steps: list  # draft steps per round (None: the drafter has no steps)
    allowed: int | None  # steps allowed per round
    draft_seconds: float  # over every round of every prompt (a batch round counted once)
    verify_seconds: float
    depth: object = None  # the adaptive policy's DepthState after the run (None: fixed depth)
    lengths: tuple = ()  # tokens emitted per round (accepted drafts + bonus), every round of every prompt
    mechanism: tuple | None = None  # fixed-size DSpark trees: (logs, prompts) for `mechanism`, read after timing
    sizes: tuple = ()  # DSpark trees: nodes drafted per round


def single_cases(budgets, depth_sweep: bool = False) -> list:
    """(label, drafter, topk, num_steps, num_draft_tokens, draft_depth)."""
    cases = [("no speculation (1-node chain)", "mtp", 1, 1, 1, "fixed")]
    for n in budgets:
        s2, s4 = TREE_STEPS[n]
        cases += [(f"chain MTP N={n}", "mtp", 1, n - 1, n, "fixed"),
                  (f"tree MTP N={n} topk 2", "mtp", 2, s2, n, "fixed"),
                  (f"tree MTP N={n} topk 4", "mtp", 4, s4, n, "fixed")]
    k, s, n = PRESET
    cases += [("preset tree, adaptive (max 5)", "mtp", k, s, n, "adaptive"),
              ("preset tree, fixed 5 steps", "mtp", k, s, n, "fixed")]
    if depth_sweep:  # depth 1 offers only topk candidates: 5 nodes
        cases += [(f"preset tree, fixed {d} steps", "mtp", k, d, n if d > 1 else k + 1, "fixed") for d in (1, 2, 3, 4)]
    return cases + [("n-gram tree N=8 topk 4", "ngram", 4, 3, 8, "fixed")]


def dspark_cases(gamma: int) -> list:
    """The DSpark comparison: its chain (N = gamma + 1) against the MTP chain at N = 4 and at the
    same N, and the MTP topk-4 tree of 8 nodes."""
    return [(f"chain DSpark N={gamma + 1}", "dspark", 1, gamma, gamma + 1, "fixed"),
            ("chain MTP N=4", "mtp", 1, 3, 4, "fixed"),
            (f"chain MTP N={gamma + 1}", "mtp", 1, gamma, gamma + 1, "fixed"),
            ("tree MTP N=8 topk 4", "mtp", 4, TREE_STEPS[8][1], 8, "fixed")]


# MTP topk-4 tree steps at the DSpark comparison's widths (6 and 12 beside TREE_STEPS' 8 and 16;
# other widths: 3)
MTP_TREE_STEPS = {6: 2, 8: TREE_STEPS[8][1], 12: 3, 16: TREE_STEPS[16][1]}


def dspark_tree_cases(gamma: int, budgets) -> list:
    """DSpark trees at equal verify widths N: its chain (N = gamma + 1 only), the Markov tree and
    the DDTree-style tree (branching without the Markov bias off the spine) at topk 2 and 4, the
    MTP topk-4 tree, and the size policy over the widest Markov tree."""
    cases = [(f"chain DSpark N={gamma + 1}", "dspark", 1, gamma, gamma + 1, "fixed")]
    for n in budgets:
        for k in (2, 4):
            if n - 1 <= k + (gamma - 1) * k * k:
                cases += [(f"tree DSpark N={n} topk {k}", "dspark", k, gamma, n, "fixed"),
                          (f"DDTree-style N={n} topk {k}", "dspark-base", k, gamma, n, "fixed")]
        cases.append((f"tree MTP N={n} topk 4", "mtp", 4, MTP_TREE_STEPS.get(n, 3), n, "fixed"))
    top = max(budgets)
    cases.append((f"DSpark size policy, N<={top} topk 4", "dspark", 4, gamma, top, "adaptive"))
    return cases


def mechanism(logs, prompts, outputs) -> dict:
    """Where a tree's branches pay, from whole runs: each draft's tree against the tokens greedy
    actually produced at its positions. logs: per prompt [(seq_len at the draft, DraftTree)].
    spine = the root's first child, its first child, ... (the chain's argmax path, in a fixed-size
    tree: a rank-0 child has the lowest candidate id of its siblings and is kept first); at the first
    depth whose spine token is not the target's: is a sibling the target's token; after an
    accepted sibling: does it hold the target's next token among its children (+1), and that
    child the one after (+2)."""
    events = dict(mismatches=0, sibling_hits=0, plus1_tries=0, plus1_hits=0, plus2_tries=0, plus2_hits=0)
    for log, prompt, out in zip(logs, prompts, outputs):
        full = list(prompt) + list(out)
        for p, tree in log:
            kids = {u: tree.children(u) for u in range(tree.num_nodes)}
            tok = tree.tokens.tolist()
            node, d = 0, 1
            while kids[node] and p + d < len(full):
                spine = kids[node][0]
                if tok[spine] == full[p + d]:
                    node, d = spine, d + 1
                    continue
                events["mismatches"] += 1
                hit = [c for c in kids[node] if tok[c] == full[p + d]]
                if hit:
                    events["sibling_hits"] += 1
                    x = hit[0]
                    for step in ("plus1", "plus2"):
                        d += 1
                        if not kids[x] or p + d >= len(full):
                            break
                        events[f"{step}_tries"] += 1
                        nxt = [c for c in kids[x] if tok[c] == full[p + d]]
                        if not nxt:
                            break
                        events[f"{step}_hits"] += 1
                        x = nxt[0]
                break
    rate = lambda a, b: events[a] / events[b] if events[b] else None  # noqa: E731
    return dict(events, sibling_hit_rate=rate("sibling_hits", "mismatches"), plus1_rate=rate("plus1_hits", "plus1_tries"),
                plus2_rate=rate("plus2_hits", "plus2_tries"))


def run_dspark(model, prompts, new_tokens, eos, kind, topk, steps, nodes, depth="fixed"):
    """run_single for a hand-built DSpark drafter ("dspark-base": the DDTree-style branching),
    logging every draft's tree for `mechanism` and the tree sizes drafted."""
    from dsv4_tree.drafters.dspark import DSparkDrafter

    spec = dt.SpecConfig(eagle_topk=topk, num_steps=steps, num_draft_tokens=nodes, draft_depth=depth)
    eng = dt.Engine(model, spec)
    drafter = DSparkDrafter(model, dt.drafters.TreeShape.from_spec(spec),
                            branching="base" if kind == "dspark-base" else "markov")
    logs, results = [], []
    real = drafter.draft

    def draft(engine, requests):
        trees = real(engine, requests)
        logs[-1].extend((r.seq_len, t) for r, t in zip(requests, trees))
        return trees

    drafter.draft = draft
    for p in prompts:
        logs.append([])
        results.append(eng.generate(p, new_tokens, drafter=drafter, eos_token_id=eos, progress=False))
    st = [r.stats for r in results]
    rounds = sum(x.rounds for x in st)
    outs = [r.tokens for r in results]
    return Run(outs, rounds, rounds, [None] * rounds, None, sum(sum(x.round_draft_seconds) for x in st),
               sum(sum(x.round_verify_seconds) for x in st), st[-1].depth,
               tuple(n for x in st for n in x.accept_lengths),
               (logs, prompts) if depth == "fixed" else None,  # sized trees may drop a rank-0 child: no spine
               tuple(t.num_nodes for log in logs for _, t in log))


def acceptance_by_depth(lengths, depth: int) -> list:
    """Per draft depth k = 1..depth: of the rounds whose drafts 1..k-1 were all accepted, the
    share that accepted draft k too (a round emitting e tokens accepted e - 1 drafts)."""
    out = []
    for k in range(1, depth + 1):
        reached = sum(1 for e in lengths if e - 1 >= k - 1)
        out.append(sum(1 for e in lengths if e - 1 >= k) / reached if reached else None)
    return out


def hf_generate(model, prompts, new_tokens):
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = model.hf.generate(torch.tensor([p], device=model.device), max_new_tokens=new_tokens, do_sample=False)
            outs.append(ids[0, len(p) :].tolist())
    return outs


def run_single(model, prompts, new_tokens, eos, kind, topk, steps, nodes, depth="fixed"):
    eng = dt.Engine(model, dt.SpecConfig(eagle_topk=topk, num_steps=steps, num_draft_tokens=nodes, draft_depth=depth))
    results = [eng.generate(p, new_tokens, drafter=kind, eos_token_id=eos, progress=False) for p in prompts]
    st = [r.stats for r in results]
    rounds = sum(x.rounds for x in st)
    return Run([r.tokens for r in results], rounds, rounds, [s for x in st for s in x.draft_steps], st[0].steps_allowed,
               sum(sum(x.round_draft_seconds) for x in st), sum(sum(x.round_verify_seconds) for x in st), st[-1].depth,
               tuple(n for x in st for n in x.accept_lengths))


def run_batch(model, prompts, new_tokens, eos, topk, steps, nodes, depth="adaptive"):
    eng = dt.Engine(model, dt.SpecConfig(eagle_topk=topk, num_steps=steps, num_draft_tokens=nodes, draft_depth=depth))
    results = eng.generate_batch(prompts, new_tokens, drafter="mtp", eos_token_id=eos, progress=False)
    # tokens per verify per request (its own rounds); verify calls = rounds of the longest, whose
    # per-round lists hold every batch round (the batch's draft steps and times)
    longest = max((r.stats for r in results), key=lambda x: x.rounds)
    return Run([r.tokens for r in results], sum(r.stats.rounds for r in results), longest.rounds, longest.draft_steps,
               longest.steps_allowed, sum(longest.round_draft_seconds), sum(longest.round_verify_seconds), longest.depth)


def timed_rounds(repeats, jobs, log=None):
    """jobs: [(fn, args)] -> [(output, seconds)]: each job's fastest of `repeats` runs (and that
    run's output), the jobs run in turn in every repeat (round-robin), so a slow spell of the
    shared machine hits every case rather than the one running then. Every run of a job must
    give the same output (a Run's tokens; its rounds and steps may follow timing)."""
    best, outs = [None] * len(jobs), [None] * len(jobs)
    same = lambda x: x.tokens if isinstance(x, Run) else x  # noqa: E731
    for rep in range(repeats):
        for j, (fn, args) in enumerate(jobs):
            t0 = time.perf_counter()
            got = fn(*args)
            secs = time.perf_counter() - t0
            if outs[j] is not None and same(got) != same(outs[j]):
                raise RuntimeError(f"{getattr(fn, '__name__', fn)}: repeated runs gave different outputs")
            if best[j] is None or secs < best[j]:
                outs[j], best[j] = got, secs
        if log is not None:
            log(f"repeat {rep + 1}/{repeats}: {len(jobs)} cases run")
    return list(zip(outs, best))


def timed(repeats, fn, *args):
    """(output, seconds) of one job: timed_rounds with a single job."""
    return timed_rounds(repeats, [(fn, args)])[0]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=4, help="held-out prompts for the single-request cases")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--batch-sizes", default="1,4,16", help="generate_batch prompt counts ('' = none)")
    ap.add_argument("--depth-sweep", action="store_true", help="also the preset tree at fixed depths 1 to 4")
    ap.add_argument("--budgets", default=None, help="verify rows per round N (default 4,8,16; 6,8,12,16 with "
                    "--dspark-trees)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (0 = torch's choice)")
    ap.add_argument("--batch-new-tokens", type=int, default=None, help="new tokens per generate_batch prompt "
                    "(default: --new-tokens)")
    ap.add_argument("--quick", action="store_true", help="1 prompt x 48 new tokens; batches of 32 new tokens")
    ap.add_argument("--repeats", type=int, default=3, help="runs per case; the fastest is reported")
    ap.add_argument("--device", default=None, help="where the model runs (default: the loader's, the CPU)")
    ap.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                    help="the model's dtype (default: the checkpoint's, fp32)")
    ap.add_argument("--dspark", action="store_true", help="the DSpark comparison instead of the default cases: DSpark "
                    "chain, MTP chains at N = 4 and gamma + 1, MTP tree N = 8 (per-depth acceptance too)")
    ap.add_argument("--dspark-trees", action="store_true", help="DSpark trees instead of the default cases: at "
                    "each --budgets width (default 6,8,12,16) the DSpark chain (N = gamma + 1), Markov and DDTree-style "
                    "trees at topk 2 and 4, the MTP tree, and the size policy; with the branching mechanism's counts")
    ap.add_argument("--only", default=None, help="comma-separated substrings: run only the single-request cases whose "
                    "label holds one of them (HF generate, and the generate_batch rows of the default cases, always run)")
    ap.add_argument("--count-ops", action="store_true", help="also aten ops per generated token (one untimed run "
                    "per single-request case)")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    n_prompts, new = (1, 48) if args.quick else (args.prompts, args.new_tokens)
    batch_new = 32 if args.quick else (args.batch_new_tokens or new)
    sizes = [int(x) for x in args.batch_sizes.split(",") if x]
    budgets = [int(x) for x in (args.budgets or ("6,8,12,16" if args.dspark_trees else "4,8,16")).split(",")]
    model = dt.load_model(dt.trained_checkpoint(), device=args.device,
                          dtype=None if args.dtype is None else getattr(torch, args.dtype))
    eos = model.hf.generation_config.eos_token_id
    prompts = [heldout_prompt(args.prompt_len, seed) for seed in range(n_prompts)]
    where = (torch.cuda.get_device_name(model.device) if model.device.type == "cuda"
             else f"{platform.machine()} CPU, {torch.get_num_threads()} torch threads")
    print(f"machine: {where}; torch {torch.__version__}; {str(model.dtype).removeprefix('torch.')}; {n_prompts} held-out prompts x {new} new bytes, greedy; generate_batch: {batch_new} new bytes each")
    print(f"{'case':<36} {'tokens/verify':>13} {'tokens/s':>9} {'x HF':>6} {'verifies':>8} {'steps':>9} "
          f"{'draft_ms':>8} {'verify_ms':>9}" + (f" {'ops/token':>9}" if args.count_ops else ""))
    records = []

    def count_ops(fn, fargs):
        """(ops per token, mean draft steps of the counted run or None)."""
        with OpCounter() as ops:
            outs = fn(*fargs)
        if not isinstance(outs, Run):
            return ops.total / sum(len(o) for o in outs), None
        steps = [s for s in outs.steps if s is not None]
        return ops.total / sum(len(o) for o in outs.tokens), (sum(steps) / len(steps) if steps else None)

    policies = []

    def report(label, outs, run, secs, want, hf_rate=None, job=None):
        tokens = sum(len(o) for o in outs)
        rounds, calls = (run.rounds, run.calls) if run else (None, None)
        steps = [s for s in run.steps if s is not None] if run else []
        rec = {"case": label, "tokens_per_verify": tokens / rounds if rounds else None,
               "tokens_per_s": tokens / secs, "verifies": calls, "output_equals_hf": outs == want,
               "draft_steps_per_round": sum(steps) / len(steps) if steps else None,
               "steps_allowed": run.allowed if steps else None,
               "draft_ms_per_round": 1e3 * run.draft_seconds / calls if run else None,
               "verify_ms_per_round": 1e3 * run.verify_seconds / calls if run else None}
        rec["x_hf"] = rec["tokens_per_s"] / (hf_rate or rec["tokens_per_s"])
        if args.count_ops and job is not None:
            rec["ops_per_token"], rec["ops_run_steps"] = count_ops(*job)
        if run is not None and run.lengths:
            rec["acceptance_by_depth"] = acceptance_by_depth(run.lengths, max(run.lengths) - 1)
        if run is not None and run.mechanism is not None:
            rec["mechanism"] = mechanism(*run.mechanism, run.tokens)
        if run is not None and run.sizes:
            rec["nodes_per_round"] = {str(n): run.sizes.count(n) for n in sorted(set(run.sizes))}  # JSON keys
        if run is not None and run.depth is not None and hasattr(run.depth, "step_seconds"):
            rec["calibration"] = list(run.depth.calibration)
            rec["step_ms"] = {b: 1e3 * s for b, s in run.depth.step_seconds.items()}
            policies.append((label, rec))
        records.append(rec)
        tpv = "-" if rounds is None else f"{rec['tokens_per_verify']:.3f}"
        st = f"{rec['draft_steps_per_round']:.2f}/{run.allowed}" if steps else "-"
        ms = (f"{rec['draft_ms_per_round']:>8.2f} {rec['verify_ms_per_round']:>9.2f}" if run else f"{'-':>8} {'-':>9}")
        print(f"{label:<36} {tpv:>13} {rec['tokens_per_s']:>9.1f} {rec['x_hf']:>6.2f} {calls or '-':>8} {st:>9} {ms}"
              + (f" {rec['ops_per_token']:>9.0f}" if "ops_per_token" in rec else "")
              + ("" if rec["output_equals_hf"] else "  OUTPUT DIFFERS FROM HF"))
        return rec["tokens_per_s"]

    if args.dspark:
        from dsv4_tree.checkpoint.dspark_names import load_dspark

        cases, sizes = dspark_cases(load_dspark(model).block_size), []
    elif args.dspark_trees:
        from dsv4_tree.checkpoint.dspark_names import load_dspark

        cases, sizes = dspark_tree_cases(load_dspark(model).block_size, budgets), []
    else:
        cases = single_cases(budgets, args.depth_sweep)
    if args.only:
        keep = [x for x in args.only.split(",") if x]
        cases = [c for c in cases if any(x in c[0] for x in keep)]
        if not cases:
            ap.error(f"--only {args.only!r} matches no case")
    batch_prompts = [heldout_prompt(args.prompt_len, 100 + seed) for seed in range(max(sizes, default=0))]
    jobs = [(hf_generate, (model, prompts, new))]
    jobs += [(run_dspark if kind.startswith("dspark") and topk > 1 else run_single,
              (model, prompts, new, eos, kind, topk, steps, nodes, depth)) for _, kind, topk, steps, nodes, depth in cases]
    if sizes:
        jobs += [(hf_generate, (model, batch_prompts[: sizes[0]], batch_new))]
        jobs += [(run_batch, (model, batch_prompts[:size], batch_new, eos, *PRESET)) for size in sizes]
    results = iter(timed_rounds(args.repeats, jobs, log=lambda line: print(line, file=sys.stderr, flush=True)))
    want, secs = next(results)
    hf_rate = report("HF generate (its own cache)", want, None, secs, want, job=jobs[0])
    for j, (label, *_) in enumerate(cases):
        run, secs = next(results)
        report(label, run.tokens, run, secs, want, hf_rate, job=jobs[1 + j])
    if sizes:
        batch_want, secs = next(results)
        batch_hf = report(f"HF generate, {batch_new} new", batch_want, None, secs, batch_want)
    for size in sizes:
        want_b = hf_generate(model, batch_prompts[:size], batch_new)
        run, secs = next(results)
        report(f"generate_batch x{size} preset, adaptive", run.tokens, run, secs, want_b, batch_hf)
    for rec in records:
        if rec.get("acceptance_by_depth"):
            print(f"acceptance by depth, {rec['case']}: "
                  + " ".join("-" if a is None else f"{a:.3f}" for a in rec["acceptance_by_depth"]))
    for rec in records:
        m = rec.get("mechanism")
        if m:
            pct = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
            print(f"mechanism, {rec['case']}: first spine mismatches {m['mismatches']}, sibling is the target's "
                  f"{pct(m['sibling_hit_rate'])}; after an accepted sibling +1 {pct(m['plus1_rate'])} "
                  f"({m['plus1_tries']}), +2 {pct(m['plus2_rate'])} ({m['plus2_tries']})")
        if rec.get("nodes_per_round") and "policy" in rec["case"]:
            print(f"size policy, {rec['case']}: rounds per node count {rec['nodes_per_round']}")
    for label, rec in policies:  # the adaptive policy's state at the end of each adaptive case's fastest run
        steps = " ".join(f"b{b} {ms:.2f}" for b, ms in rec["step_ms"].items())
        line = f"policy, {label}: calibration by depth {' '.join(f'{c:.2f}' for c in rec['calibration'])}; step ms {steps}"
        if rec.get("ops_run_steps") is not None:
            line += f"; its ops/token run drafted {rec['ops_run_steps']:.2f} steps per round"
        print(line)
    print(json.dumps({"bench": "accept", "threads": torch.get_num_threads(), "quick": args.quick, "repeats": args.repeats,
                      "records": records}))


if __name__ == "__main__":
    main()
