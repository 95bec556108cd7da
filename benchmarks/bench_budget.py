"""DSpark verify budgets against the chains they must beat, on the shipped checkpoint.

Cases (each its own engine and drafter, kept across repetitions; generate_batch at bs 1, 4, 16):

* DSpark chain fixed (gamma + 1 nodes every round) and DSpark chain adaptive (SGLang 0.5.23's
  confidence-scheduled length: the batch budget from survival two rounds old against a cost table,
  the shape from this round's survival);
* DSpark tree budgeted (topk 4, at most --tree-nodes nodes per request: the batch's best nodes by
  value under one budget) and the same tree at a forced gamma + 1 nodes per request on average
  (the equal-nodes comparison with the fixed chain);
* MTP chain (the checkpoint preset's, fixed) and MTP tree (topk 4, 5 steps, 8 nodes, adaptive).

The two adaptive DSpark drafters get a cost table measured on their own engine at start-up
(`profile_costs`, on prompts that are not the benchmark's); every case runs one warm-up batch on
other prompts first (the budgeted trees fit their node values on it). Prompts: held-out stdlib
files (the corpus the checkpoint was trained on) and this project's own Python sources (outside
it). Greedy and sampled (temperature 1). Repetitions are interleaved (every case once, then
again, a sampled case with the same seed each time) and each case keeps its fastest; greedy
outputs are checked equal to Hugging Face's.
Human table, a PNG of tokens/s against batch size (matplotlib), and as the last line one JSON
object with every record and the issue's targets as ratios."""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

import dsv4_tree as dt
from dsv4_tree.drafters.base import TreeShape
from dsv4_tree.budget.cost_profile import profile_costs
from dsv4_tree.drafters.dspark import DSparkDrafter
from dsv4_tree.train.corpus import heldout_prompt


def project_prompt(length: int, seed: int) -> list:
    """`length` bytes of one of this project's own .py files (outside the stdlib training corpus),
    the file and the offset chosen by seed."""
    files = sorted(p for p in Path(dt.__file__).resolve().parent.rglob("*.py") if p.stat().st_size > 4 * length)
    data = files[(7 * seed) % len(files)].read_bytes()
    start = (977 * seed) % (len(data) - length)
    return list(data[start : start + length])


CORPORA = {"stdlib": heldout_prompt, "project": project_prompt}


def cases(gamma: int, tree_nodes: int) -> list:
    """(label, drafter kind, topk, num_steps, num_draft_tokens, draft_depth, forced nodes per request)."""
    return [("dspark chain fixed", "dspark", 1, gamma, gamma + 1, "fixed", None),
            ("dspark chain adaptive", "dspark", 1, gamma, gamma + 1, "adaptive", None),
            ("dspark tree budgeted", "dspark", 4, gamma, tree_nodes, "adaptive", None),
            (f"dspark tree {gamma + 1} nodes", "dspark", 4, gamma, tree_nodes, "adaptive", gamma + 1),
            ("mtp chain", "mtp", 1, 3, 4, "fixed", None),
            ("mtp tree", "mtp", 4, 5, 8, "adaptive", None)]


class Case:
    def __init__(self, model, label, kind, topk, steps, nodes, depth, forced, accept, max_bs):
        self.label, self.kind, self.accept, self.forced = label, kind, accept, forced
        self.spec = dt.SpecConfig(eagle_topk=topk, num_steps=steps, num_draft_tokens=nodes, draft_depth=depth,
                                  accept=accept, max_requests=max_bs)
        self.engine = dt.Engine(model, self.spec)
        self.drafter = "mtp"
        if kind == "dspark":
            self.drafter = DSparkDrafter(model, TreeShape.from_spec(self.spec),
                                         size="adaptive" if forced is not None else None)
            if forced is not None:
                self.drafter.policy.forced_nodes = forced

    def run(self, prompts, new_tokens: int, seed: int) -> tuple:
        """-> (seconds, outputs) of one generate_batch."""
        temp = 1.0 if self.accept == "sampling" else None
        g = torch.Generator().manual_seed(seed) if temp else None
        t0 = time.perf_counter()
        outs = self.engine.generate_batch(prompts, new_tokens, drafter=self.drafter, temperature=temp, generator=g,
                                          progress=False)
        return time.perf_counter() - t0, outs


def summarise(case, corpus, bs, secs, outs) -> dict:
    accept = [a for o in outs for a in o.stats.accept_lengths]
    nodes = [n for o in outs for n in o.stats.round_nodes]
    tokens = sum(len(o.tokens) for o in outs)
    longest = max(outs, key=lambda o: o.stats.rounds).stats  # live in every batch round
    draft_ms, verify_ms = (1e3 * sum(x) / max(1, len(x)) for x in (longest.round_draft_seconds,
                                                                   longest.round_verify_seconds))
    return {"case": case.label, "accept": case.accept, "corpus": corpus, "bs": bs, "seconds": secs,
            "tokens": tokens, "tokens_per_s": tokens / secs, "request_rounds": len(accept),
            "tokens_per_verify": sum(accept) / len(accept), "mean_nodes_per_round": sum(nodes) / len(nodes),
            "round_nodes_histogram": {str(n): nodes.count(n) for n in sorted(set(nodes))},
            "verifies": longest.rounds, "draft_ms_per_round": draft_ms, "verify_ms_per_round": verify_ms,
            "other_ms_per_round": 1e3 * secs / max(1, longest.rounds) - draft_ms - verify_ms}


def targets(records, gamma: int) -> list:
    """The issue's targets as measured ratios, per corpus and acceptance rule."""
    at = {(r["case"], r["accept"], r["corpus"], r["bs"]): r for r in records}
    out = []
    for corpus in CORPORA:
        for accept in ("greedy", "sampling"):
            for bs in sorted({r["bs"] for r in records}):
                get = lambda label: at.get((label, accept, corpus, bs))  # noqa: E731
                fixed, adaptive = get("dspark chain fixed"), get("dspark chain adaptive")
                tree = get("dspark tree budgeted")
                equal = get(f"dspark tree {gamma + 1} nodes")
                if not (fixed and adaptive and tree and equal):
                    continue
                best_chain = max(fixed["tokens_per_s"], adaptive["tokens_per_s"])
                out.append({"corpus": corpus, "accept": accept, "bs": bs,
                            "equal_nodes_tree_over_chain_tokens_per_verify":
                                equal["tokens_per_verify"] / fixed["tokens_per_verify"],
                            "equal_nodes_tree_nodes": equal["mean_nodes_per_round"],
                            "chain_nodes": fixed["mean_nodes_per_round"],
                            "tree_over_best_chain_tokens_per_s": tree["tokens_per_s"] / best_chain,
                            "adaptive_over_fixed_chain_tokens_per_s": adaptive["tokens_per_s"] / fixed["tokens_per_s"],
                            "adaptive_chain_nodes": adaptive["mean_nodes_per_round"], "gamma_plus_1": gamma + 1,
                            "tree_budgeted_nodes": tree["mean_nodes_per_round"],
                            "tree_over_chain_tokens_per_verify":
                                tree["tokens_per_verify"] / fixed["tokens_per_verify"]})
    return out


def plot(records, path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot: skipped (matplotlib is not installed: pip install 'dsv4-tree[bench]')"
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    panels = [(c, a) for c in CORPORA for a in ("greedy", "sampling")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4), sharey=True)
    for ax, (corpus, accept) in zip(axes, panels):
        for label in dict.fromkeys(r["case"] for r in records):
            rs = sorted((r for r in records if (r["case"], r["corpus"], r["accept"]) == (label, corpus, accept)),
                        key=lambda r: r["bs"])
            ax.plot([r["bs"] for r in rs], [r["tokens_per_s"] for r in rs], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("requests per batch (bs)")
        ax.set_title(f"{corpus} prompts, {accept}")
    axes[0].set_ylabel("generated tokens/s (fastest of k)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return f"plot: {path}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--bs", default="1,4,16", help="comma list of batch sizes")
    ap.add_argument("--new-tokens", type=int, default=32, help="tokens generated per request")
    ap.add_argument("--prompt-len", type=int, default=96, help="prompt bytes")
    ap.add_argument("--reps", type=int, default=2, help="interleaved repetitions; each case keeps its fastest")
    ap.add_argument("--tree-nodes", type=int, default=16, help="the budgeted tree's most nodes per request")
    ap.add_argument("--accept", default="greedy,sampling", help="comma list of: greedy, sampling")
    ap.add_argument("--corpora", default="stdlib,project", help="comma list of: stdlib, project")
    ap.add_argument("--profile-rounds", type=int, default=5, help="profile_costs rounds per node count and bs")
    ap.add_argument("--plot", default="bench_out/bench_budget.png", help="PNG path ('' to skip)")
    args = ap.parse_args(argv)
    bss = [int(x) for x in args.bs.split(",")]
    accepts, corpora = args.accept.split(","), args.corpora.split(",")
    bad = [c for c in corpora if c not in CORPORA] + [a for a in accepts if a not in ("greedy", "sampling")]
    if bad:
        raise SystemExit(f"unknown --corpora / --accept values: {bad}")
    t_start = time.perf_counter()
    model = dt.load_model(dt.trained_checkpoint())
    from dsv4_tree.checkpoint.dspark_names import load_dspark

    gamma = load_dspark(model).block_size
    max_bs = max(bss)
    prompts = {c: [CORPORA[c](args.prompt_len, seed) for seed in range(max_bs)] for c in corpora}
    warm = [heldout_prompt(args.prompt_len, 300 + s) for s in range(max_bs)]  # neither benchmark set
    profile_prompts = [heldout_prompt(args.prompt_len, 400 + s) for s in range(max_bs)]
    hf = {c: [model.hf.generate(torch.tensor([p]), max_new_tokens=args.new_tokens, do_sample=False)[0, len(p):].tolist()
              for p in ps] for c, ps in prompts.items()}
    runs = [Case(model, *spec, accept, max_bs) for accept in accepts for spec in cases(gamma, args.tree_nodes)]
    tables = {}
    for case in runs:  # the adaptive DSpark drafters' cost tables, measured once per shape on the greedy engine
        d = case.drafter
        if isinstance(d, DSparkDrafter) and case.forced is None and case.spec.depth_mode == "adaptive":
            key = case.spec.eagle_topk
            if key not in tables:
                prof = Case(model, case.label, "dspark", case.spec.eagle_topk, case.spec.num_steps,
                            case.spec.num_draft_tokens, "adaptive", gamma + 1, "greedy", max_bs)
                prof.drafter.policy.forced_nodes = None
                t0 = time.perf_counter()
                tables[key] = profile_costs(prof.engine, prof.drafter, profile_prompts, batch_sizes=bss,
                                            rounds=args.profile_rounds)
                print(f"[profile] topk {key}: {tables[key]} ({time.perf_counter() - t0:.1f}s)", file=sys.stderr)
            d.set_cost_table(tables[key])
        case.run(warm, args.new_tokens, seed=10**6)  # warm-up; budgeted trees fit their node values on it
    best, mismatches = {}, []
    for rep in range(args.reps):
        for corpus in corpora:
            for bs in bss:
                for case in runs:
                    secs, outs = case.run(prompts[corpus][:bs], args.new_tokens, seed=bs)  # same draws each rep
                    if case.accept == "greedy" and [o.tokens for o in outs] != hf[corpus][:bs]:
                        mismatches.append((case.label, corpus, bs, rep))
                    key = (case.label, case.accept, corpus, bs)
                    if key not in best or secs < best[key]["seconds"]:
                        best[key] = summarise(case, corpus, bs, secs, outs)
        print(f"[rep {rep}] done at {time.perf_counter() - t_start:.0f}s", file=sys.stderr, flush=True)
    records = list(best.values())
    machine = f"{platform.machine()} CPU, {torch.get_num_threads()} torch threads"
    print(f"machine: {machine}; torch {torch.__version__}; shipped checkpoint, DSpark gamma {gamma}; prompts "
          f"{args.prompt_len} bytes, {args.new_tokens} new tokens each; fastest of {args.reps} interleaved repetitions")
    print(f"{'case':<24} {'accept':<8} {'corpus':<8} {'bs':>3} {'tok/s':>8} {'tok/verify':>10} {'nodes/round':>11} "
          f"{'verifies':>8} {'draft ms':>8} {'verify ms':>9} {'other ms':>8}")
    for r in records:
        print(f"{r['case']:<24} {r['accept']:<8} {r['corpus']:<8} {r['bs']:>3} {r['tokens_per_s']:>8.1f} "
              f"{r['tokens_per_verify']:>10.3f} {r['mean_nodes_per_round']:>11.2f} {r['verifies']:>8} "
              f"{r['draft_ms_per_round']:>8.1f} {r['verify_ms_per_round']:>9.1f} {r['other_ms_per_round']:>8.1f}")
    summary = targets(records, gamma)
    print("targets (ratios; want: equal-nodes tree/chain tokens/verify >= 1 off-corpus, budgeted tree / best chain "
          "tokens/s >= 1.05 at bs 16 and >= 1.0 at bs 1 greedy, >= 0.97 sampled, adaptive / fixed chain tokens/s "
          ">= 1 at bs 16 with fewer "
          f"than {gamma + 1} nodes per request-round):")
    for s in summary:
        print(f"  {s['corpus']:<8} {s['accept']:<8} bs {s['bs']:>2}: equal-nodes tok/verify x"
              f"{s['equal_nodes_tree_over_chain_tokens_per_verify']:.3f} ({s['equal_nodes_tree_nodes']:.2f} vs "
              f"{s['chain_nodes']:.2f} nodes), tree/best chain tok/s x{s['tree_over_best_chain_tokens_per_s']:.3f} "
              f"({s['tree_budgeted_nodes']:.2f} nodes), adaptive/fixed tok/s x"
              f"{s['adaptive_over_fixed_chain_tokens_per_s']:.3f} ({s['adaptive_chain_nodes']:.2f} nodes)")
    print(f"greedy outputs equal Hugging Face's: {'yes' if not mismatches else f'NO: {mismatches}'}")
    print(plot(records, args.plot) if args.plot else "plot: skipped (--plot '')")
    print(json.dumps({"machine": machine, "torch": torch.__version__, "gamma": gamma, "new_tokens": args.new_tokens,
                      "prompt_len": args.prompt_len, "reps": args.reps, "greedy_equal_hf": not mismatches,
                      "mismatches": mismatches,
                      "cost_tables": {str(k): json.loads(t.to_json()) for k, t in tables.items()},
                      "targets": summary, "records": records}))
    return 0 if not mismatches else 1


if __name__ == "__main__":
    sys.exit(main())
