"""One rank of the 2-rank runs tests/test_ranks.py launches under torchrun (gloo, CPU).

Usage: torchrun --standalone --nproc-per-node 2 tests/ranks_worker.py OUT_DIR HF_DIR RELEASE_DIR TRAINED_DIR

Loads the tiny checkpoints sharded (TP; EP with both token paths; TP on the release format)
and unsharded, runs every check on both, and writes what it measured to OUT_DIR/rank<R>.json.
Verify and commit run on the random tiny checkpoints; generation on the dense cases runs on the
shipped trained checkpoint, whose MTP block gets drafts accepted (a random one accepts none, so
only the bonus path would be exercised). The assertions live in test_ranks.py;
the assertions live in test_ranks.py. One launch for all cases: starting the process group
and importing torch and transformers costs more than the checks themselves."""
from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from pathlib import Path

import torch

import dsv4_tree as dt
from cases import prompt, random_tree
from dsv4_tree.errors import StateError
from dsv4_tree.reference import relative_error

SPEC = dt.SpecConfig(eagle_topk=4, num_steps=3, num_draft_tokens=12)
NEW_TOKENS = 10


def case_configs(hf_dir: str, release_dir: str) -> dict:
    from transformers import DistributedConfig

    return {
        "tp": (hf_dir, DistributedConfig(tp_size=2)),
        "ep_all_reduce": (hf_dir, DistributedConfig(tp_size=2, ep_size=2, ep_implementation="all_reduce")),
        "ep_all_to_all": (hf_dir, DistributedConfig(tp_size=2, ep_size=2, ep_implementation="all_to_all")),
        "tp_release": (release_dir, DistributedConfig(tp_size=2)),
    }


def serial_decode(eng, p, tokens):
    """Feed `tokens` one decode step each (1-node trees) after prefill(p): the serial state."""
    req = eng.prefill(p)
    seq = [req.root_token] + list(tokens)
    for i in range(len(tokens)):
        out = eng.verify([req], [dt.DraftTree.chain([seq[i]])])
        eng.commit([req], [dt.Acceptance((0,), seq[i + 1], req.request_id, out.verify_id)], out)
    return req


def state_diff(eng, a, b) -> float:
    """Largest difference of two requests' committed states, relative to each field's largest
    magnitude (inf if they differ in tokens or layout)."""
    if a.seq_len != b.seq_len or a.root_token != b.root_token or not torch.equal(a.tokens, b.tokens):
        return float("inf")
    worst = 0.0
    for sa, sb in zip(eng.state_summary(a), eng.state_summary(b)):
        if sa.keys() != sb.keys() or any(sa[k].shape != sb[k].shape for k in sa):
            return float("inf")
        for k in sa:
            if sa[k].numel():
                x, y = sa[k].double(), sb[k].double()
                worst = max(worst, float((x - y).abs().max() / y.abs().max().clamp(min=1e-30)))
    return worst


def deepest_path(tree) -> tuple:
    parents = tree.parents.tolist()
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    node, path = max(range(len(parents)), key=lambda i: (depth[i], -i)), []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return tuple(reversed(path))


def verify_and_commit(sharded, plain) -> dict:
    es, ep = dt.Engine(sharded, SPEC), dt.Engine(plain, SPEC)
    prompts = [prompt(41, seed=1), prompt(23, seed=2)]
    trees = [random_tree(int(p[-1]), 12, 3, 4, seed=10 + i) for i, p in enumerate(prompts)]
    rs, rp = es.prefill_batch(prompts), ep.prefill_batch(prompts)
    out_s, out_p = es.verify(rs, trees), ep.verify(rp, trees)
    rel = max(relative_error(a, b) for a, b in zip(out_s.logits, out_p.logits))
    exact = all(torch.equal(a, b) for a, b in zip(out_s.logits, out_p.logits))
    path, bonus = deepest_path(trees[0]), 3
    accs = [dt.Acceptance(path, bonus, rs[0].request_id, out_s.verify_id),
            dt.Acceptance((0,), 4, rs[1].request_id, out_s.verify_id)]
    es.commit(rs, accs, out_s)
    serial = serial_decode(es, prompts[0], trees[0].tokens[list(path[1:])].tolist() + [bonus])
    diff = state_diff(es, rs[0], serial)
    # and the next verify of the committed request still equals the unsharded engine's
    ep.commit(rp, [dt.Acceptance(a.path, a.bonus, r.request_id, out_p.verify_id) for a, r in zip(accs, rp)], out_p)
    nxt = random_tree(rs[0].root_token, 8, 3, 3, seed=30)
    after = relative_error(es.verify([rs[0]], [nxt]).logits[0], ep.verify([rp[0]], [nxt]).logits[0])
    for eng, reqs in ((es, rs + [serial]), (ep, rp)):
        for req in reqs:
            eng.release(req)
    return {"verify_rel": rel, "verify_exact": exact, "commit_vs_serial": diff, "verify_after_commit_rel": after,
            "committed_depth": len(path) - 1}


def generation(sharded, plain, rank: int, p: list) -> dict:
    es, ep = dt.Engine(sharded, SPEC), dt.Engine(plain, SPEC)
    greedy = es.generate(p, NEW_TOKENS, drafter="mtp")
    # fixed depth: a seed repeats its draws only on the same trees, and adaptive trees follow
    # each process's clock (design_notes/adaptive-depth.md)
    sampling = SPEC.replace(accept="sampling", draft_depth="fixed")
    ss, sp = dt.Engine(sharded, sampling), dt.Engine(plain, sampling)
    draws = torch.rand(4).tolist()  # proves the ranks' global RNGs differ
    return {
        "greedy": greedy.tokens, "greedy_plain": ep.generate(p, NEW_TOKENS, drafter="mtp").tokens,
        "greedy_tokens_per_verify": greedy.stats.mean_tokens_per_verify,
        "sampled_global_rng": ss.generate(p, NEW_TOKENS, drafter="mtp").tokens,
        # a user generator, seeded 7 on rank 0 and differently on the others: rank 0 decides
        "sampled_generator": ss.generate(p, NEW_TOKENS, drafter="mtp",
                                         generator=torch.Generator().manual_seed(7 + rank)).tokens,
        "sampled_plain_seed7": sp.generate(p, NEW_TOKENS, drafter="mtp", generator=torch.Generator().manual_seed(7)).tokens,
        "global_draws": draws,
        # several requests per round, each with its own budget; EOS = the prompt's last byte
        "batch": [r.tokens for r in es.generate_batch([p, p[:40]], [6, 9], drafter="mtp", eos_token_id=p[-1])],
        "batch_plain": [r.tokens for r in ep.generate_batch([p, p[:40]], [6, 9], drafter="mtp", eos_token_id=p[-1])],
    }


def adaptive_depth(sharded, plain, rank: int, p: list) -> dict:
    """Ranks whose own timings disagree: rank 1's policy is seeded with draft steps a billion
    times dearer than a round's tokens (alone it would stop after step 1 every round), rank
    0's with free steps. Rank 0 decides, so both run the same steps and the same trees."""
    from dsv4_tree.drafters.base import TreeShape
    from dsv4_tree.drafters.mtp import MtpDrafter

    eng = dt.Engine(sharded, SPEC)
    drafter = MtpDrafter(sharded, TreeShape.from_spec(SPEC), depth="adaptive")
    step = 0.0 if rank == 0 else 1e9
    drafter.policy.step_seconds.update({1: step})
    drafter.policy.round_seconds.update({1: 1.0})
    drafter.policy.round_tokens.update({1: 1.0})
    out = eng.generate(p, NEW_TOKENS, drafter=drafter)
    return {"adaptive_tokens": out.tokens, "adaptive_steps": out.stats.draft_steps,
            "adaptive_plain": dt.Engine(plain, SPEC).generate(p, NEW_TOKENS, drafter="mtp").tokens}


def dspark_size(sharded, plain, rank: int, p: list) -> dict:
    """DSpark tree budgets on ranks whose cost tables disagree: rank 1's says every node costs a
    thousand rounds (alone it would draft the roots only), rank 0's that nodes are free. Rank 0
    decides, so both draft rank 0's sizes and the same trees."""
    from dsv4_tree.drafters.base import TreeShape
    from dsv4_tree.budget.cost_table import LineTable
    from dsv4_tree.drafters.dspark import DSparkDrafter

    spec = dt.SpecConfig(eagle_topk=2, num_steps=3, num_draft_tokens=8)
    table = LineTable((1,), (1.0,), (0.0 if rank == 0 else 1e3,))
    drafter = DSparkDrafter(sharded, TreeShape.from_spec(spec), size="adaptive", cost_table=table)
    sizes, real = [], drafter.draft

    def draft(engine, requests):
        trees = real(engine, requests)
        sizes.append(trees[0].num_nodes)
        return trees

    drafter.draft = draft
    out = dt.Engine(sharded, spec).generate(p, NEW_TOKENS, drafter=drafter)
    # sampled: drawn trees (drafters/dspark_drawn.py) from each rank's copy of one seed; a draft that
    # differed between ranks would fail verify's fingerprint check
    drawn = dt.Engine(sharded, dt.SpecConfig(eagle_topk=2, num_steps=3, num_draft_tokens=8, accept="sampling"))
    sampled = drawn.generate(p, NEW_TOKENS, drafter="dspark", temperature=1.0, generator=torch.Generator().manual_seed(7))
    return {"dspark_tokens": out.tokens, "dspark_sizes": sizes, "dspark_sampled": sampled.tokens,
            "dspark_sampled_nodes": sampled.stats.round_nodes,
            "dspark_plain": dt.Engine(plain, spec).generate(p, NEW_TOKENS, drafter="dspark").tokens}


def hf_custom_generate(sharded, plain, rank: int, p: list) -> dict:
    """transformers' generate on the sharded model with custom_generate=dt.custom_generate.
    Sampling: each rank draws from its own global RNG (seeded differently); rank 0's draws
    decide. Greedy with a length processor (min_new_tokens, EOS = the 3rd token of the free
    run): rank 1 asks for another minimum, so only rank 0's decision can keep the ranks in
    step; both return transformers' own unsharded output for rank 0's minimum."""
    ids = torch.tensor([p])
    free = plain.hf.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS)[0, len(p):].tolist()
    greedy = dict(do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=[free[2]])
    out = {"hf_greedy_plain": plain.hf.generate(ids, min_new_tokens=6, **greedy)[0].tolist()}
    try:
        out["hf_sampled"] = sharded.hf.generate(ids, do_sample=True, temperature=2.0, top_k=3, max_new_tokens=NEW_TOKENS,
                                                custom_generate=dt.custom_generate)[0].tolist()
        out["hf_greedy"] = sharded.hf.generate(ids, min_new_tokens=6 if rank == 0 else 1, custom_generate=dt.custom_generate,
                                               **greedy)[0].tolist()
    except StateError as exc:  # ranks that fell out of step: recorded, the assertions name it
        out["hf_error"] = str(exc)
    return out


def divergence(sharded, rank: int) -> dict:
    """Ranks handed different trees / prompts raise StateError together; state is unchanged."""
    es = dt.Engine(sharded, SPEC)
    req = es.prefill(prompt(20, seed=4))
    seen = {}
    try:
        es.verify([req], [dt.DraftTree.chain([req.root_token, 5 + rank])])
        seen["tree"] = "none"
    except StateError:
        seen["tree"] = "StateError"
    try:
        es.prefill([1, 2, 3 + rank])
        seen["prompt"] = "none"
    except StateError:
        seen["prompt"] = "StateError"
    out = es.verify([req], [dt.DraftTree.chain([req.root_token, 5])])  # the same tree on every rank: runs
    seen["after_logits_shape"] = list(out.logits[0].shape)
    seen["seq_len"] = req.seq_len
    return seen


def cli_run(argv) -> str:
    from dsv4_tree.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(argv)
    return f"rc={rc}\n{buf.getvalue()}"


def main(out_dir: str, hf_dir: str, release_dir: str, trained_dir: str) -> None:
    from dsv4_tree.train.corpus import heldout_prompt

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    torch.manual_seed(1000 + 17 * rank)  # the ranks' global RNGs differ on purpose
    plain = {d: dt.load_model(d) for d in (hf_dir, release_dir, trained_dir)}
    for m in plain.values():
        assert m.ranks is None
    results = {"rank": rank}
    for name, (path, cfg) in case_configs(hf_dir, release_dir).items():
        sharded = dt.load_model(path, distributed_config=cfg)
        res = {"sharded": sharded.ranks is not None, "dtensors": sum(
            type(p).__name__ == "DTensor" for p in sharded.hf.parameters())}
        res.update(verify_and_commit(sharded, plain[path]))
        if path == hf_dir:  # generation on the trained checkpoint, sharded the same way
            gen, p = dt.load_model(trained_dir, distributed_config=cfg), heldout_prompt(60, seed=1)
            res.update(generation(gen, plain[trained_dir], rank, p))
            if name == "tp":
                res.update(adaptive_depth(gen, plain[trained_dir], rank, p))
                res.update(dspark_size(gen, plain[trained_dir], rank, p))
                res.update(hf_custom_generate(gen, plain[trained_dir], rank, p))
        else:
            res.update(generation(sharded, plain[path], rank, prompt(30, seed=3).tolist()))
        if name == "tp":
            res["divergence"] = divergence(sharded, rank)
        results[name] = res
    common = ["generate", "--checkpoint", hf_dir, "--drafter", "mtp", "--max-new-tokens", "8", "--topk", "2",
              "--num-steps", "3", "--prompt-len", "20"]
    results["cli_tp"] = cli_run(common + ["--tp", "2"])
    results["cli_ep"] = cli_run(common + ["--ep", "2", "--ep-implementation", "all_to_all"])
    results["cli_plain"] = cli_run(common)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:5])
