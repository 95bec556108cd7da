"""Command line: `dsv4-tree demo` (verify rounds checked per path) and `dsv4-tree generate`."""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from .config import DRAFT_DEPTHS, MASK_MODES, SpecConfig
from .drafters import PlantedDrafter, TreeShape
from .drafters.base import default_tree_nodes
from .cli_train import add_train_commands
from .drafters.registry import DRAFTER_NAMES, resolve_drafter, tell_sampling
from .engine import Engine
from .errors import Dsv4TreeError, InputError
from .generate import GenerateStats, resolve_sampling
from .model.adapter import load_model
from .checkpoint.tiny import trained_checkpoint
from .cli_args import check_args, int_at_least, prompt_text, real_in, seed_value, spec_preset, token_ids
from .reference.per_path import per_path_logits, relative_error
from .round_stats import describe, end_round, note_round, timed_verify

REL_ERR_BOUND = 1e-4  # fp32: see design_notes/tolerances.md


def _spec_args(p: argparse.ArgumentParser, mask_mode: bool) -> None:
    p.add_argument("--checkpoint", default=None,
                   help="checkpoint directory: HF layout (config.json + *.safetensors) or DeepSeek's release "
                        "format (FP8/FP4, sharded), loaded on CPU in fp32; default: the shipped "
                        "trained byte-level checkpoint (dsv4_tree/checkpoints/tiny-stdlib-bytes)")
    p.add_argument("--spec", type=spec_preset, default=None,
                   help="SpecConfig TOML preset (configs/*.toml); each flag below replaces only its own field of it")
    p.add_argument("--topk", type=int_at_least(1), default=None,
                   help="eagle_topk: children per draft node; >1 drafts trees")
    p.add_argument("--num-steps", type=int_at_least(1), default=None, help="num_steps: maximum draft depth")
    p.add_argument("--num-draft-tokens", type=int_at_least(1), default=None,
                   help="num_draft_tokens: nodes per tree, root included. Default: a chain has num_steps+1; a "
                        "tree keeps the --spec preset's count; a chain made a tree by --topk K gets "
                        "min(2*num_steps + K, 1 + K + (num_steps-1)*K^2)")
    p.add_argument("--accept", choices=("greedy", "sampling"), default=None,
                   help="acceptance rule (SpecConfig.accept; default: the preset's, else greedy)")
    p.add_argument("--draft-depth", choices=DRAFT_DEPTHS, default=None,
                   help="draft_depth: adaptive (num_steps is a maximum; the MTP drafter stops when a step does not "
                        "pay; DSpark verifies what one batch budget buys: SGLang's confidence-scheduled chain "
                        "length, or a tree's best nodes by value) or fixed (every round drafts num_steps); default "
                        "adaptive for trees, fixed for chains")
    if mask_mode:
        p.add_argument("--mask-mode", choices=MASK_MODES, default=None,
                       help="layout of the SGLang-compatible tree mask (SpecConfig.mask_mode) that --tensors-out saves")
    p.add_argument("--temperature", type=real_in(0.0, float("inf")), default=None,
                   help="sampling temperature (accept=sampling; default 1.0); greedy refuses values other than 0")
    p.add_argument("--top-p", type=real_in(0.0, 1.0, low_open=True), default=1.0, help="nucleus for sampling, in (0, 1]")
    p.add_argument("--seed", type=seed_value, default=0,
                   help="seed for the prompt, the drafter and sampling (0 to 2^63-1)")
    p.add_argument("--threads", type=int_at_least(0), default=1,
                   help="torch CPU threads (default 1: on the shipped tiny models intra-op threads cost more than "
                        "they save, and far more when other processes share the cores); 0 = torch's choice")


# the default demo runs both, on the same prompt, at the same verify-row budget scale; the tree
# is SGLang's default (configs/tree_topk4.toml): at most 5 steps, the depth chosen per round
DEMO_MODES = {"chain": SpecConfig(num_steps=3), "tree": SpecConfig(eagle_topk=4, num_steps=5, num_draft_tokens=8)}


def _spec_given(args) -> bool:
    return any(v is not None for v in (args.spec, args.topk, args.num_steps, args.num_draft_tokens))


def _spec(args, base: SpecConfig | None = None) -> SpecConfig:
    """The preset (or base) with each given flag replacing its own field (see --help)."""
    spec = args.spec or base or SpecConfig()  # args.spec: the preset --spec read (cli_args.spec_preset)
    changes = {}
    if args.topk is not None:
        changes["eagle_topk"] = args.topk
    if args.num_steps is not None:
        changes["num_steps"] = args.num_steps
    for flag in ("accept", "mask_mode", "draft_depth"):
        if getattr(args, flag, None) is not None:
            changes[flag] = getattr(args, flag)
    if args.num_draft_tokens is not None:
        changes["num_draft_tokens"] = args.num_draft_tokens
    elif spec.eagle_topk == 1 and changes.get("eagle_topk", 1) > 1:
        changes["num_draft_tokens"] = default_tree_nodes(changes["eagle_topk"], changes.get("num_steps", spec.num_steps))
    return spec.replace(**changes) if changes else spec


def _load(args):
    from transformers.utils import logging as hf_logging

    if args.threads:
        torch.set_num_threads(args.threads)
    hf_logging.disable_progress_bar()
    tp, ep = getattr(args, "tp", None), getattr(args, "ep", None)
    dtype = getattr(torch, getattr(args, "dtype", "float32"))
    if tp is None and ep is None:
        return load_model(args.checkpoint or trained_checkpoint(), dtype=dtype)
    from .checkpoint.parallel import distributed_config_for

    config = distributed_config_for(tp, ep, args.ep_implementation or "auto")
    return load_model(args.checkpoint or trained_checkpoint(), dtype=dtype, distributed_config=config)


def _is_bytes(model) -> bool:
    from .train.corpus import VOCAB

    return model.vocab_size == VOCAB


def _prompt(model, length: int, seed: int, text: str | None = None) -> list:
    """Byte-level models: held-out stdlib source (or `text`); others: seeded random ids."""
    from .train.corpus import encode, heldout_prompt

    if _is_bytes(model):
        return encode(text) if text is not None else heldout_prompt(length, seed)
    if text is not None:
        raise InputError("--prompt-text needs a byte-level checkpoint")
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, model.vocab_size, (length,), generator=g).tolist()


def _drafter(engine, args):
    if args.drafter == "planted":  # with the CLI's corruption rate and seed
        return PlantedDrafter(engine.model, TreeShape.from_spec(engine.spec), corrupt=args.corrupt, seed=args.seed)
    return resolve_drafter(engine, args.drafter)


def _dspark_spec(args, model) -> SpecConfig:
    """The DSpark chain of the checkpoint's block size gamma (eagle_topk 1, gamma steps, gamma + 1
    nodes), with the spec flags given on top (--topk K: its Markov tree, gamma deep)."""
    from .checkpoint.dspark_names import load_dspark

    gamma = load_dspark(model).block_size
    return _spec(args, SpecConfig(eagle_topk=1, num_steps=gamma, num_draft_tokens=gamma + 1))


def cmd_demo(args) -> int:
    model = _load(args)
    prompt = torch.tensor(_prompt(model, args.prompt_len, args.seed, args.prompt_text))
    if args.drafter == "dspark":  # DSpark: the chain of its block size, or the tree the flags ask for
        modes = {"custom" if _spec_given(args) else "chain": _dspark_spec(args, model)}
    elif _spec_given(args):
        modes = {"custom": _spec(args)}
    else:
        modes = {m: _spec(args, s) for m, s in DEMO_MODES.items()}
    results = {}
    for mode, spec in modes.items():
        results[mode] = _demo_run(model, spec, prompt, args)
    line = " | ".join(f"{mode} (topk={r[0].eagle_topk} N={r[0].num_draft_tokens}): {r[1]:.2f} tokens/verify, "
                      f"{r[2]:.1f} tokens/s, {'PASS' if r[3] else 'FAIL'}" for mode, r in results.items())
    print(f"compare: {line}")
    return 0 if all(r[3] for r in results.values()) else 1


def _demo_run(model, spec, prompt, args) -> tuple:
    """Verify rounds of one mode, each checked per path. -> (spec, tokens/verify, tokens/s, ok)"""
    engine = Engine(model, spec)
    drafter = _drafter(engine, args)
    temperature = resolve_sampling(spec.accept, args.temperature, args.top_p)
    gen = torch.Generator().manual_seed(args.seed)
    req = engine.prefill(prompt)
    saved = []
    tell_sampling(drafter, temperature, args.top_p, gen)
    what = {"mtp": "the checkpoint's MTP block (EAGLE-2)", "ngram": "prompt lookup",
            "dspark": "the checkpoint's DSpark block drafter (one backbone pass, Markov head)",
            "planted": f"synthetic: target greedy continuation among random siblings, corrupt={args.corrupt}"}
    print(f"demo: {model.source or 'in-memory model'} | topk={spec.eagle_topk} num_steps={spec.num_steps} "
          f"num_draft_tokens={spec.num_draft_tokens} draft_depth={spec.depth_mode} | prompt {prompt.numel()} tokens | "
          f"drafter: {args.drafter} "
          f"({what[args.drafter]}) | accept={spec.accept}"
          + (f" temperature={temperature} top_p={args.top_p}" if temperature is not None else ""))
    print(f"{'round':>5} {'P':>6} {'nodes':>5} {'depth':>5} {'steps':>5} {'accepted':>8} {'rel_err':>10} "
          f"{'draft_ms':>8} {'verify_ms':>9} {'ties':>4}")
    worst, emitted, t_verify, t_round = 0.0, 0, 0.0, 0.0
    stats = GenerateStats()
    for rnd in range(args.rounds):
        t_start = time.perf_counter()
        tree = drafter.draft(engine, [req])[0]
        dt_draft = time.perf_counter() - t_start
        out, dt_verify = timed_verify(engine, [req], [tree])
        t_verify += dt_verify
        if temperature is None:
            acc = engine.accept_greedy([req], [tree], out)[0]
        else:
            acc = engine.accept_sampling([req], [tree], out, temperature, args.top_p, gen)[0]
        if args.tensors_out:
            saved.append(engine.tree_tensors([req], [tree])._asdict())
        p = req.seq_len
        engine.commit([req], [acc], out)
        end_round(drafter, [req])
        t_round += time.perf_counter() - t_start  # draft + verify + accept + commit, not the check
        note_round(stats, drafter, dt_draft, dt_verify)
        stats.round_nodes.append(tree.num_nodes)
        ref = per_path_logits(model, req.tokens[:p], tree)
        err = relative_error(out.logits[0], ref)
        worst = max(worst, err)
        emitted += acc.num_accepted + 1
        steps = "-" if stats.draft_steps[-1] is None else stats.draft_steps[-1]
        print(f"{rnd:>5} {p:>6} {tree.num_nodes:>5} {tree.max_depth:>5} {steps:>5} {acc.num_accepted:>8} {err:>10.2e} "
              f"{1000 * dt_draft:>8.1f} {1000 * dt_verify:>9.1f} {out.topk_ties:>4}")
    if _is_bytes(model):
        from .train.corpus import decode

        print("continuation: " + repr(decode(req.tokens[prompt.numel() - 1 :].tolist() + [req.root_token])))
    if args.tensors_out:
        torch.save({"mask_mode": spec.mask_mode, "rounds": saved}, args.tensors_out)
        print(f"tree tensors ({spec.mask_mode}) of {len(saved)} rounds: {args.tensors_out}")
    ok = worst <= REL_ERR_BOUND
    engine.release(req)
    print(f"summary: {args.rounds} verify rounds, {emitted} tokens, {emitted / args.rounds:.2f} tokens/verify, "
          f"{stats.mean_nodes_per_round:.2f} nodes/verify, "
          f"{emitted / t_round:.1f} tokens/s (whole rounds, without the check), worst relative error vs per-path "
          f"reference {worst:.2e} (bound {REL_ERR_BOUND:.0e}): {'PASS' if ok else 'FAIL'}; verify time "
          f"{t_verify:.2f} s. (ties: rows whose indexer top-k boundary was an exact or near tie, decided by the "
          "documented tie rule, which the reference applies too)")
    print(f"rounds: {describe(stats)}\n")
    return spec, emitted / args.rounds, emitted / t_round, ok


def cmd_generate(args) -> int:
    model = _load(args)
    engine = Engine(model, _dspark_spec(args, model) if args.drafter == "dspark" else _spec(args))
    drafter = _drafter(engine, args)
    prompt = args.prompt if args.prompt is not None else _prompt(model, args.prompt_len, args.seed, args.prompt_text)
    gen = torch.Generator().manual_seed(args.seed)
    res = engine.generate(prompt, args.max_new_tokens, drafter=drafter, temperature=args.temperature,
                          top_p=args.top_p, eos_token_id=args.eos, generator=gen)
    if model.ranks is not None and torch.distributed.get_rank() != 0:
        return 0  # every rank generated the same tokens (dsv4_tree/ranks.py); rank 0 reports them
    st = res.stats
    print(f"generated {len(res.tokens)} tokens in {st.rounds} verifies: "
          f"{st.mean_tokens_per_verify:.3f} tokens/verify, {st.mean_nodes_per_round:.2f} nodes verified per round "
          f"(root included), verify time {st.verify_seconds:.2f} s")
    print(f"accept-length histogram: {st.histogram}")
    print(f"rounds: {describe(st)}")
    if _is_bytes(model):
        from .train.corpus import decode

        print("text: " + repr(decode(res.tokens)))
    print(json.dumps({"tokens": res.tokens, "mean_tokens_per_verify": st.mean_tokens_per_verify,
                      "rounds": st.rounds, "histogram": st.histogram, "round_nodes": st.round_nodes,
                      "mean_nodes_per_round": st.mean_nodes_per_round, "draft_steps": st.draft_steps,
                      "steps_allowed": st.steps_allowed}))
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dsv4-tree", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="verify rounds as a chain and as a tree on the same prompt, every round checked "
                                    "against per-path HF runs; --topk/--num-steps/--num-draft-tokens/--spec run one mode")
    _spec_args(d, mask_mode=True)
    d.add_argument("--prompt-len", type=int_at_least(2), default=150,
                   help="prompt length: held-out stdlib bytes for byte-level checkpoints, random ids otherwise")
    d.add_argument("--prompt-text", type=prompt_text, default=None, help="prompt text (byte-level checkpoints)")
    d.add_argument("--drafter", choices=DRAFTER_NAMES, default="mtp",
                   help="mtp: the checkpoint's MTP block; dspark: its DSpark block drafter (a chain of its block size "
                        "gamma; --topk K > 1: its Markov tree, gamma deep unless --num-steps); ngram: prompt lookup; "
                        "planted: synthetic test drafter")
    d.add_argument("--rounds", type=int_at_least(1), default=8, help="verify rounds to run")
    d.add_argument("--corrupt", type=real_in(0.0, 1.0), default=0.25,
                   help="probability that a planted draft token is replaced by a random one")
    d.add_argument("--tensors-out", default=None,
                   help="save each round's SGLang-compatible tree tensors (mask in --mask-mode layout) to this .pt "
                        "file, in an existing directory")
    d.set_defaults(func=cmd_demo)
    g = sub.add_parser("generate", help="speculative greedy or sampled generation with a drafter")
    _spec_args(g, mask_mode=False)
    g.add_argument("--drafter", choices=DRAFTER_NAMES, default="ngram",
                   help="ngram: prompt lookup (model-free); mtp: the checkpoint's MTP block, EAGLE-2 trees; "
                        "dspark: its DSpark block drafter (its chain of gamma drafts; --topk K > 1: its Markov tree, gamma "
                        "deep unless --num-steps); "
                        "planted: synthetic test drafter")
    g.add_argument("--prompt", type=token_ids, default=None,
                   help="comma-separated token ids (default: a seeded prompt; not with --prompt-text)")
    g.add_argument("--prompt-len", type=int_at_least(2), default=64, help="length of the default prompt")
    g.add_argument("--prompt-text", type=prompt_text, default=None, help="prompt text (byte-level checkpoints)")
    g.add_argument("--max-new-tokens", type=int_at_least(1), default=64, help="token budget")
    g.add_argument("--eos", type=int_at_least(0), default=None, help="stop after this token id")
    g.add_argument("--corrupt", type=real_in(0.0, 1.0), default=0.25, help="planted drafter: corruption probability")
    g.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="model dtype (a release checkpoint is dequantised to it)")
    g.add_argument("--tp", type=int_at_least(2), default=None,
                   help="tensor parallelism over N ranks (under torchrun --nproc-per-node N): transformers' own "
                        "plan, experts split, embedding and head split by vocabulary")
    g.add_argument("--ep", type=int_at_least(2), default=None,
                   help="expert parallelism over N ranks (under torchrun; tp_size = ep_size = N): whole experts "
                        "per rank")
    g.add_argument("--ep-implementation", choices=("auto", "all_reduce", "all_to_all"), default=None,
                   help="how --ep brings the experts their tokens (transformers' ep_implementation; default "
                        "auto); needs --ep")
    g.set_defaults(func=cmd_generate)
    add_train_commands(sub)
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    check_args(ap, args)
    try:
        return args.func(args)
    except Dsv4TreeError as exc:
        print(f"dsv4-tree: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
