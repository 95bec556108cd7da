#!/usr/bin/env python3
"""One-request smoke test of the dsv4_tree SGLang plug-in on a GPU machine.

Runs the same greedy request through SGLang 0.5.23 three times on a DeepSeek-V4 checkpoint:
topk 1 with CUDA graphs (SGLang's own chain path, the baseline), topk K > 1 with CUDA graphs (the
plug-in's tree path, graphed), and topk K eagerly (`--disable-cuda-graph`), and checks that the
generated token ids are identical. `--algorithm EAGLE` (default) drafts with the checkpoint's MTP
layer; `--algorithm DSPARK` with its DSpark block drafter (a checkpoint with `dspark_*` config
keys): the baseline is SGLang's DSpark chain (N = gamma + 1), the tree launches the plug-in's
DSpark tree step (`--speculative-eagle-topk K --speculative-num-draft-tokens N`, with
SGLANG_DSPARK_FOLDED_PROPOSAL=0, which the tree requires). Exit status: 0 identical, 1 the outputs
differ, 2 a launch or request failed (or bad arguments), 3 they differ first at a near tie: the
baseline's two best tokens there lie within NEAR_TIE nats. All runs are exact greedy decoders, but
in bf16 they verify through kernels of different shapes (4 rows against 8), whose roundings can
swap two tokens whose logits are that close; 3 says to retry with another prompt rather than that
the tree path is wrong.

Each configuration runs SGLang's offline engine (`sglang.Engine`, no HTTP server or port) in
a fresh Python process of its own, started by this script: SGLang applies plug-ins once per
process, and a process exit is the one sure way to hand all GPU memory back before the next
launch. The launches use the same arguments except the speculative ones and, for the last,
`--disable-cuda-graph`.

    python scripts/sglang_smoke.py /path/to/DeepSeek-V4-Flash --tp 8
    python scripts/sglang_smoke.py /path/to/DeepSeek-V4-Flash --tp 8 --dry-run
    python scripts/sglang_smoke.py /path/to/DeepSeek-V4-Flash --tp 8 --algorithm DSPARK

`--dry-run` prints the launches (command line, environment, engine arguments) and resolves
their server arguments through SGLang's own pipeline with the plug-in loaded, which runs the
plug-in's validator, without loading weights or needing a GPU (use `--device cpu` where
there is none); it exits non-zero if any is refused."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

RESULT = "SMOKE_RESULT "
LAUNCHES = 3
# nats between the best two tokens below which a bf16 run's argmax may swap: bf16 keeps 8
# significant bits, so a logit of magnitude ~10-30 carries a rounding of ~0.04-0.1 per value
NEAR_TIE = 0.1
ALGORITHMS = ("EAGLE", "DSPARK")
# what the DSpark tree step needs (SGLang's default folds a chain proposal into the draft graph)
DSPARK_TREE_ENV = {"SGLANG_DSPARK_FOLDED_PROPOSAL": "0"}
DEFAULT_PROMPT = ("Explain, step by step, how a binary search tree keeps its keys ordered, how insertion and "
                  "deletion work, and why a balanced tree answers lookups in logarithmic time.")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_path", help="a DeepSeek-V4 checkpoint directory (DeepseekV4ForCausalLM)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (GPUs per launch)")
    p.add_argument("--algorithm", choices=ALGORITHMS, default="EAGLE", help="the drafter: the MTP layer (EAGLE) or "
                   "DSpark (DSPARK, the checkpoint's dspark_* block drafter)")
    p.add_argument("--topk", type=int, default=4, help="--speculative-eagle-topk of the tree launch (> 1)")
    p.add_argument("--num-steps", type=int, default=3, help="--speculative-num-steps of both EAGLE launches "
                   "(DSPARK: 1, its depth is the block size)")
    p.add_argument("--num-draft-tokens", type=int, default=8, help="--speculative-num-draft-tokens of the tree launch")
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--device", default="cuda")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per launch (loading included)")
    p.add_argument("--dry-run", action="store_true", help="print the launches and resolve their arguments only")
    p.add_argument("--child", help=argparse.SUPPRESS)  # internal: one launch, as JSON
    a = p.parse_args(argv)
    if a.child is None:
        if a.topk <= 1:
            p.error(f"--topk must be > 1 for the tree launch, got {a.topk}")
        if a.num_steps < 1 or a.max_new_tokens < 1 or a.tp < 1:
            p.error("--num-steps, --max-new-tokens and --tp must be positive")
        if not (Path(a.model_path) / "config.json").is_file():
            p.error(f"model_path {a.model_path!r} has no config.json")
    return a


def launches(a: argparse.Namespace) -> list[dict]:
    """The three launches: name, sglang.Engine keyword arguments, environment additions."""
    algorithm = getattr(a, "algorithm", "EAGLE")
    common = dict(model_path=a.model_path, tp_size=a.tp, device=a.device, speculative_algorithm=algorithm,
                  dsv4_attn_backend="flashmla", disable_cuda_graph=False, random_seed=0)
    env = {"SGLANG_PLUGINS": "dsv4_tree"}  # SGLang's plug-in whitelist: this plug-in only
    if algorithm == "DSPARK":  # SGLang resolves one step and, for the chain, N = gamma + 1
        chain = dict(common, speculative_eagle_topk=1)
        tree = dict(common, speculative_eagle_topk=a.topk, speculative_num_draft_tokens=a.num_draft_tokens)
        tree_env = dict(env, **DSPARK_TREE_ENV)
    else:
        common["speculative_num_steps"] = a.num_steps
        chain = dict(common, speculative_eagle_topk=1, speculative_num_draft_tokens=a.num_steps + 1)
        tree = dict(common, speculative_eagle_topk=a.topk, speculative_num_draft_tokens=a.num_draft_tokens)
        tree_env = env
    return [{"name": f"{algorithm} topk 1, CUDA graphs (SGLang's chain path)", "engine_kwargs": chain, "env": env},
            {"name": f"{algorithm} topk {a.topk}, CUDA graphs (dsv4_tree tree path)", "engine_kwargs": tree,
             "env": tree_env},
            {"name": f"{algorithm} topk {a.topk}, eager (dsv4_tree tree path)",
             "engine_kwargs": dict(tree, disable_cuda_graph=True), "env": tree_env}]


def sampling_params(a: argparse.Namespace) -> dict:
    return {"temperature": 0.0, "max_new_tokens": a.max_new_tokens}


def child_command(a: argparse.Namespace, launch: dict) -> list[str]:
    spec = {"engine_kwargs": launch["engine_kwargs"], "prompt": a.prompt, "sampling_params": sampling_params(a)}
    return [sys.executable, os.path.abspath(__file__), a.model_path, "--child", json.dumps(spec)]


def run_child(spec_json: str) -> None:
    """One launch in this process: sglang.Engine, one request, one result line."""
    spec = json.loads(spec_json)
    import sglang
    from sglang.srt.plugins.hook_registry import HookRegistry

    from dsv4_tree.sglang_plugin import HOOK_TARGETS

    engine = sglang.Engine(**spec["engine_kwargs"])
    try:
        out = engine.generate(prompt=spec["prompt"], sampling_params=spec["sampling_params"],
                              return_logprob=True, top_logprobs_num=2)
    finally:
        engine.shutdown()
    meta = out.get("meta_info", {})
    print(RESULT + json.dumps({
        "output_ids": out.get("output_ids"), "text": out.get("text"),
        "top2": [[[float(e[0]), int(e[1])] for e in (pos or [])[:2]] for pos in meta.get("output_top_logprobs") or []],
        "hooks_applied": sorted(t for t in HOOK_TARGETS if t in HookRegistry._patched),
        "spec": {k: v for k, v in meta.items() if k.startswith("spec_")}}), flush=True)


def resolve(launch: dict) -> dict:
    """SGLang's own server-argument resolution with the plug-in loaded (no weights)."""
    from sglang.srt.server_args import ServerArgs

    try:
        args = ServerArgs(**launch["engine_kwargs"])
        args.resolve_once()
    except BaseException as exc:  # what SGLang's launcher would report
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    r = args.resolved_dict()
    keys = ("speculative_algorithm", "speculative_eagle_topk", "speculative_num_steps", "speculative_num_draft_tokens",
            "speculative_dspark_block_size", "page_size", "attention_backend", "dsv4_attn_backend",
            "disable_cuda_graph")
    return {"ok": True, "resolved": {k: r.get(k) for k in keys}}


def dry_run(a: argparse.Namespace) -> int:
    plan = launches(a)
    os.environ.update(plan[0]["env"])
    import sglang.srt.plugins as plugins

    plugins.load_plugins()
    report = []
    for launch in plan:
        saved = dict(os.environ)
        os.environ.update(launch["env"])  # each launch resolves under its own environment
        try:
            res = resolve(launch)
        finally:
            os.environ.clear()
            os.environ.update(saved)
        report.append(dict(launch, command=child_command(a, launch), sampling_params=sampling_params(a), **res))
        state = "accepted" if res["ok"] else "REFUSED: " + res["error"]
        print(f"[dry-run] {launch['name']}: {state}", file=sys.stderr)
    print(json.dumps({"launches": report}))
    return 0 if all(r["ok"] for r in report) else 2


def launch_once(a: argparse.Namespace, launch: dict, index: int) -> dict | None:
    print(f"[{index}/{LAUNCHES}] {launch['name']}: starting SGLang (loads the checkpoint; can take minutes)", flush=True)
    t0 = time.time()
    try:
        proc = subprocess.run(child_command(a, launch), env=dict(os.environ, **launch["env"]), capture_output=True,
                              text=True, timeout=a.timeout)
    except subprocess.TimeoutExpired:
        print(f"[{index}/{LAUNCHES}] {launch['name']}: no result after {a.timeout:.0f} s", file=sys.stderr)
        return None
    lines = [x for x in proc.stdout.splitlines() if x.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        print(f"[{index}/{LAUNCHES}] {launch['name']}: failed (exit {proc.returncode}); last output:\n"
              f"{(proc.stdout + proc.stderr)[-4000:]}", file=sys.stderr)
        return None
    res = json.loads(lines[-1][len(RESULT):])
    print(f"[{index}/{LAUNCHES}] {launch['name']}: {len(res['output_ids'] or [])} tokens in {time.time() - t0:.0f} s, "
          f"speculative stats {res['spec']}, plug-in hooks applied: {len(res['hooks_applied'])}", flush=True)
    return res


def compare(chain: dict, tree: dict) -> int:
    a, b = chain["output_ids"] or [], tree["output_ids"] or []
    if not a or not b:
        print(f"FAILED: no tokens generated (topk 1: {len(a)}, tree: {len(b)})", file=sys.stderr)
        return 2
    if a == b:
        print(f"OK: greedy outputs identical ({len(a)} tokens)")
        return 0
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    print(f"MISMATCH: greedy outputs differ at token {first} (topk 1: {len(a)} tokens, tree: {len(b)} tokens)\n"
          f"  topk 1 ids[{first}:{first + 8}] = {a[first:first + 8]}\n  tree   ids[{first}:{first + 8}] = "
          f"{b[first:first + 8]}\n  topk 1 text: {chain['text']!r}\n  tree   text: {tree['text']!r}", file=sys.stderr)
    margin = top2_margin(chain, first)
    if margin is None:
        print("  (no top-2 logprobs at that token: cannot tell a near tie from a real difference)", file=sys.stderr)
        return 1
    if margin < NEAR_TIE:
        print(f"NEAR TIE: at token {first} the topk 1 run's best two tokens are {margin:.3f} nats apart "
              f"(< {NEAR_TIE}): within bf16 rounding of kernels of different shapes; retry with another prompt",
              file=sys.stderr)
        return 3
    print(f"  the topk 1 run's best two tokens there are {margin:.3f} nats apart (>= {NEAR_TIE}): not a near tie",
          file=sys.stderr)
    return 1


def top2_margin(run: dict, i: int) -> float | None:
    """Log-probability gap between the run's best two tokens at output position i (None if absent)."""
    top = run.get("top2") or []
    if i >= len(top) or len(top[i]) < 2:
        return None
    return top[i][0][0] - top[i][1][0]


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.child is not None:
        run_child(a.child)
        return 0
    if a.dry_run:
        return dry_run(a)
    results = []
    for i, launch in enumerate(launches(a), 1):
        res = launch_once(a, launch, i)
        if res is None:
            return 2
        results.append(res)
    return compare_all(results, [launch["name"] for launch in launches(a)])


def compare_all(results: list, names: list) -> int:
    """Every run against the first (the topk 1 baseline): 0 all identical, else the worst outcome
    (2 no tokens, 1 a real difference, 3 a near tie only)."""
    codes = []
    for res, name in zip(results[1:], names[1:]):
        print(f"{name} against {names[0]}:")
        codes.append(compare(results[0], res))
    for worst in (2, 1, 3):
        if worst in codes:
            return worst
    return 0


if __name__ == "__main__":
    sys.exit(main())
