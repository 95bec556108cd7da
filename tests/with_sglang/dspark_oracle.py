"""The engine's side of the DSpark tree round test (test_sglang_dspark_rounds.py), run in the
project's main environment (transformers 5.23, which the shipped tiny checkpoint needs; SGLang's
environment has 5.19): greedy DSpark tree rounds of the shipped checkpoint for a batch of
prompts through the engine (`Engine` + `DSparkDrafter`, the fixed-size Markov tree: the best
N - 1 candidates by path probability), recorded round by round, plus each prompt's
`Engine.generate(drafter="dspark")` at the same tree shape (its default, confidence-sized trees)
and Hugging Face's greedy tokens.

argv: output file, N (num_draft_tokens), rounds, new tokens for generate / HF, prompt lengths...
Writes one torch.save dict."""
import sys

import torch

import dsv4_tree as dt
from dsv4_tree.drafters.base import TreeShape
from dsv4_tree.drafters.dspark import DSparkDrafter
from dsv4_tree.train.corpus import heldout_prompt

GAMMA, TOPK = 5, 4


def main() -> None:
    out_path, n, rounds, new = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    prompts = [heldout_prompt(int(length), seed=3 + i) for i, length in enumerate(sys.argv[5:])]
    model = dt.load_model(dt.trained_checkpoint())
    spec = dict(eagle_topk=TOPK, num_steps=GAMMA, num_draft_tokens=n)
    eng = dt.Engine(model, dt.SpecConfig(**spec, draft_depth="fixed"))
    drafter = DSparkDrafter(model, TreeShape(TOPK, GAMMA, n), record=True)
    eng.register_drafter(drafter)
    reqs = eng.prefill_batch(prompts)
    module = drafter.module
    trace = {"prompts": prompts, "gamma": GAMMA, "topk": TOPK, "n": n, "rounds": [],
             "prefill": [{"seq_len": r.seq_len, "root": r.root_token, "features": r.new_features.clone()} for r in reqs],
             "markov_w1": module.markov_embed.weight.detach().clone(),
             "markov_w2": module.markov_head.weight.detach().clone()}
    for _ in range(rounds):
        before = [(r.seq_len, r.root_token) for r in reqs]
        trees = drafter.draft(eng, reqs)
        recs = [drafter.records[r.request_id] for r in reqs]
        out = eng.verify(reqs, trees)
        accs = eng.accept_greedy(reqs, trees, out)
        eng.commit(reqs, accs, out)
        per = []
        for b, (req, tree, rec, acc) in enumerate(zip(reqs, trees, recs, accs)):
            o, count = out.plan.offsets[b], out.plan.num_nodes[b]
            per.append({"seq_len": before[b][0], "anchor": before[b][1], "base": rec.base.clone(),
                        "hidden": rec.hidden.clone(), "tokens": tree.tokens.clone(), "parents": tree.parents.clone(),
                        "logits": out.logits[b].detach().clone(),
                        "features": out.run.features[o:o + count].detach().clone(), "path": list(acc.path),
                        "bonus": int(acc.bonus), "committed_features": req.new_features.clone()})
        trace["rounds"].append(per)
    ref = dt.Engine(model, dt.SpecConfig(**spec))  # the default tree size: the confidence-sized policy
    trace["generate"] = [list(ref.generate(p, new, drafter="dspark", progress=False).tokens) for p in prompts]
    with torch.no_grad():
        trace["hf_greedy"] = [model.hf.generate(torch.tensor(p).unsqueeze(0), max_new_tokens=new,
                                                do_sample=False)[0, len(p):].tolist() for p in prompts]
    torch.save(trace, out_path)


if __name__ == "__main__":
    main()
