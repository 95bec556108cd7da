"""The shipped trained byte-level checkpoint and the training script."""
import json
import math

import torch

import dsv4_tree as dt
from cases import assert_weights_from_file
from dsv4_tree.drafters import MtpDrafter, TreeShape
from dsv4_tree.checkpoint.mtp import load_mtp
from dsv4_tree.train import TrainConfig, train
from dsv4_tree.train.corpus import heldout_prompt
from test_generate import hf_greedy


def test_shipped_checkpoint_weights_come_from_the_file():
    path = dt.trained_checkpoint()
    ours = dt.load_model(path)
    assert_weights_from_file(ours.hf, path)  # bf16 on disk, exactly upcast to fp32
    assert ours.config.layer_types.count("heavily_compressed_attention") >= 1
    assert ours.config.compress_rates["heavily_compressed_attention"] == 128
    assert isinstance(load_mtp(ours), torch.nn.Module)
    meta = json.loads((path / "training.json").read_text())
    assert meta["final_val_bpb"] < 4.0, "the shipped model should have learned something"
    assert (path / "loss_curve.png").is_file() and (path / "README.md").is_file()


def test_greedy_with_mtp_on_trained_checkpoint_equals_plain_greedy():
    model = dt.load_model(dt.trained_checkpoint())
    ids = torch.tensor(heldout_prompt(160, 1))
    want = hf_greedy(model, ids, 24)
    eng = dt.Engine(model, dt.SpecConfig(eagle_topk=2, num_steps=3, num_draft_tokens=6))
    res = eng.generate(ids, 24, drafter=MtpDrafter(model, TreeShape(2, 3, 6)), progress=False)
    assert res.tokens == want
    assert res.stats.mean_tokens_per_verify > 1.0  # trained MTP drafts get accepted


def test_training_script_runs_and_loss_decreases(tmp_path):
    cfg = TrainConfig(steps=12, batch=2, seq_len=130, lr=3e-3, warmup=2, eval_every=6, eval_batches=1, max_files=4,
                      save_every=100)
    hist = train(cfg, tmp_path / "ck", log=lambda m: None)
    first, last = sum(hist["train_bpb"][:3]) / 3, sum(hist["train_bpb"][-3:]) / 3
    assert last < first - 0.2, f"train loss did not drop: {first:.3f} -> {last:.3f}"
    assert hist["val_bpb"][-1] < hist["val_bpb"][0]
    model = dt.load_model(tmp_path / "ck")
    assert math.isfinite(float(model.hf.lm_head.weight.detach().float().sum()))
    assert load_mtp(model) is not None


def test_train_mtp_retrains_the_block_alone_and_says_so(tmp_path):
    """train-mtp against the frozen shipped target: the MTP loss drops, the written checkpoint has
    new mtp.0.* tensors and every other tensor byte for byte, training.json and the card record
    the run, and the block loads and drafts exactly (greedy equal to plain greedy)."""
    from safetensors.torch import load_file

    from dsv4_tree.train.mtp_trainer import train_mtp

    src = dt.trained_checkpoint()
    model = dt.load_model(src)
    before = [p.detach().clone() for p in model.hf.parameters()]
    cfg = TrainConfig(steps=8, batch=2, seq_len=130, lr=3e-3, warmup=2, eval_every=2, eval_batches=1, max_files=4)
    hist = train_mtp(model, cfg, tmp_path / "ck", log=lambda m: None, command="dsv4-tree train-mtp ...")
    assert hist["val_mtp_bpb"][-1] < hist["val_mtp_bpb"][0] - 0.5, hist["val_mtp_bpb"]
    assert all(torch.equal(a, b) for a, b in zip(before, model.hf.parameters())), "the target must stay frozen"
    old, new = load_file(str(src / "model.safetensors")), load_file(str(tmp_path / "ck" / "model.safetensors"))
    assert old.keys() == new.keys()
    assert all(torch.equal(old[k], new[k]) for k in old if not k.startswith("mtp."))
    assert not torch.equal(old["mtp.0.e_proj.weight"], new["mtp.0.e_proj.weight"])
    meta = json.loads((tmp_path / "ck" / "training.json").read_text())
    assert meta["mtp_retrain"]["train_config"]["steps"] == 8 and meta["final_val_bpb"] == json.loads(
        (src / "training.json").read_text())["final_val_bpb"]
    assert "## MTP block (retrained)" in (tmp_path / "ck" / "README.md").read_text()
    retrained = dt.load_model(tmp_path / "ck")
    ids = torch.tensor(heldout_prompt(40, 3))
    eng = dt.Engine(retrained, dt.SpecConfig(eagle_topk=2, num_steps=2, num_draft_tokens=4))
    assert eng.generate(ids, 8, drafter="mtp", progress=False).tokens == hf_greedy(retrained, ids, 8)


def test_oracle_with_tie_rule_matches_where_ties_occur():
    """The trained model (4 index heads) has exact ReLU-zero ties at the top-k boundary in
    its committed rows; with the documented tie rule on both sides every node matches."""
    from dsv4_tree.reference import per_path_logits, relative_error

    model = dt.load_model(dt.trained_checkpoint())
    eng = dt.Engine(model, dt.SpecConfig(eagle_topk=4, num_steps=5, num_draft_tokens=16))
    drafter = MtpDrafter(model, TreeShape(4, 5, 16))
    req = eng.prefill(torch.tensor(heldout_prompt(150, 0)))
    assert req.committed_topk_ties > 0, "the case must have ties in its committed rows"
    worst, untouched, ties = 0.0, 0.0, 0
    for _ in range(3):
        tree = drafter.draft(eng, [req])[0]
        out = eng.verify([req], [tree])
        ties += out.topk_ties
        worst = max(worst, relative_error(out.logits[0], per_path_logits(model, req.tokens, tree)))
        hf = per_path_logits(model, req.tokens, tree, apply_tie_rule=False)
        untouched = max(untouched, relative_error(out.logits[0], hf))
        eng.commit([req], eng.accept_greedy([req], [tree], out), out)
    # the case really has ties in verified rows, and they matter: HF's unspecified choice among
    # tied entries misses the bound (measured: 1 tied row, 7.5e-3), the shared rule meets it
    assert ties >= 1, f"no indexer tie in the verified rows ({ties=}): the case no longer tests the tie rule"
    assert untouched > 1e-4, f"untouched HF matches without the tie rule ({untouched=:.2e}): no tie exercised"
    assert worst < 1e-4, f"worst relative error {worst:.2e} with the tie rule on both sides ({ties=})"
