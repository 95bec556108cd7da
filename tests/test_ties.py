"""Indexer top-k ties in committed rows are counted (design_notes/indexer-tie-rule.md): prefill
rows all, and of each verify exactly the accepted path's rows that commit folds in."""
import torch

import dsv4_tree as dt
from dsv4_tree.drafters import MtpDrafter, TreeShape
from dsv4_tree.train.corpus import heldout_prompt


def test_committed_row_ties_are_counted_through_prefill_and_commit():
    model = dt.load_model(dt.trained_checkpoint())  # 4 index heads: exact ReLU-zero ties are common
    eng = dt.Engine(model, dt.SpecConfig(eagle_topk=4, num_steps=5, num_draft_tokens=16, prefill_chunk=64))
    ids = torch.tensor(heldout_prompt(150, 0))
    req = eng.prefill(ids)  # three chunks
    # the same 149 rows as one chain verify from a one-token request (P = 0)
    chain = dt.Engine(model, dt.SpecConfig(num_steps=148, num_draft_tokens=149))
    same_rows = chain.verify([chain.prefill(ids[:1])], [dt.DraftTree.chain(ids[:-1])]).topk_ties
    assert req.committed_topk_ties == same_rows > 0, f"{req.committed_topk_ties=} {same_rows=}"
    drafter = MtpDrafter(model, TreeShape(4, 5, 16))
    for _ in range(3):
        tree = drafter.draft(eng, [req])[0]
        out = eng.verify([req], [tree])
        before = req.committed_topk_ties
        acc = eng.accept_greedy([req], [tree], out)
        eng.commit([req], acc, out)
        path = torch.tensor(acc[0].path)
        assert req.committed_topk_ties - before == int(out.run.topk_ties[path].sum())
    # every committed row recomputed by one prefill: the same ties
    replay = eng.prefill(torch.cat([req.tokens, torch.tensor([req.root_token])]))
    assert replay.committed_topk_ties == req.committed_topk_ties, f"{replay.committed_topk_ties=}"
