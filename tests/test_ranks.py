"""Several ranks through transformers' own tensor / expert parallelism: 2 ranks, gloo, the CPU.

One torchrun launch for the module (tests/ranks_worker.py runs every case on both ranks and
writes what it measured); the tests below assert on it. The refusals and the per-rank sizes
need no process group and run in this process."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import DistributedConfig

import dsv4_tree as dt
from dsv4_tree.errors import InputError
from dsv4_tree.checkpoint.parallel import distributed_config_for
from dsv4_tree.checkpoint.rank_size import rank_size
from dsv4_tree.ranks import _fingerprint, agree_acceptances, check_same

TESTS = Path(__file__).resolve().parent
CASES = ("tp", "ep_all_reduce", "ep_all_to_all", "tp_release")
EP_CASES = ("ep_all_reduce", "ep_all_to_all")
# TP vs one process is the same fp32 math with its sums reassociated: each routed expert's
# down projection sums its inputs as one half per rank plus an all-reduce, and the vocabulary-
# split head and column-split gate-up run GEMMs of other shapes, whose blocking orders the
# partial sums differently. That is the kind of difference a request batched vs alone has
# (same math, other GEMM shapes), bounded at 1e-5 relative in design_notes/tolerances.md
# (measured here 6.9e-7 dense, 1.0e-6 release-format). A missing or doubled all-reduce, a
# wrong shard or a shard left uncast changes the routed output by O(1).
TP_TOL = 1e-5
# commit copies verify's rows; serial decode recomputes them one row per forward (same bound
# as tests/test_commit.py, taken relative to each field's largest value: the release-format
# model's values are not O(1))
STATE_TOL = 1e-5


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """The two ranks' results (a list indexed by rank), from one torchrun launch."""
    from dsv4_tree.checkpoint.tiny import trained_checkpoint

    dirs = [dt.tiny_checkpoint(), dt.tiny_checkpoint(format="release"), trained_checkpoint()]  # made here, once
    out = tmp_path_factory.mktemp("ranks")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(TESTS / "ranks_worker.py"), str(out)] + [str(d) for d in dirs]
    # the CPU and gloo, also on a CUDA machine (one GPU cannot hold two NCCL ranks)
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1")
    proc = subprocess.run(cmd, cwd=TESTS, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"torchrun failed (rc {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_every_case_loads_sharded(ranks):
    layers = dt.tiny_config().num_hidden_layers
    for r, res in enumerate(ranks):
        assert res["rank"] == r
        for case in CASES:
            # each layer's gate_up and down experts, the embedding and the LM head; nothing else
            assert res[case]["sharded"] and res[case]["dtensors"] == 2 * layers + 2, f"{case=} {r=} {res[case]}"


@pytest.mark.parametrize("case", CASES)
def test_tree_verify_equals_single_process(ranks, case):
    for r, res in enumerate(ranks):
        got = res[case]
        # EP: whole experts per rank, the same GEMMs on the same rows; only where a token's expert
        # outputs are added up moves (per rank, then across), and with top-2 routing (the tiny
        # checkpoints) that is a two-term sum, the same in either order: bitwise equal
        if case in EP_CASES:
            assert got["verify_exact"] and got["verify_after_commit_rel"] == 0.0, f"{case=} {r=} {got}"
        else:
            assert got["verify_rel"] < TP_TOL and got["verify_after_commit_rel"] < TP_TOL, f"{case=} {r=} {got}"


@pytest.mark.parametrize("case", CASES)
def test_commit_equals_serial_decode(ranks, case):
    for r, res in enumerate(ranks):
        got = res[case]
        assert got["committed_depth"] == 3 and got["commit_vs_serial"] < STATE_TOL, f"{case=} {r=} {got}"


@pytest.mark.parametrize("case", CASES)
def test_mtp_greedy_equals_single_process(ranks, case):
    for r, res in enumerate(ranks):
        got = res[case]
        assert got["greedy"] == got["greedy_plain"] and len(got["greedy"]) == 10, f"{case=} {r=}"
        assert got["batch"] == got["batch_plain"], f"{case=} {r=} generate_batch"
        if case != "tp_release":  # the trained checkpoint: drafts are accepted, trees exercised
            assert got["greedy_tokens_per_verify"] > 1.5, f"{case=} {r=} {got['greedy_tokens_per_verify']}"


@pytest.mark.parametrize("case", CASES)
def test_sampled_tokens_identical_on_every_rank(ranks, case):
    a, b = ranks[0][case], ranks[1][case]
    assert a["global_draws"] != b["global_draws"], "the ranks' global RNGs were meant to differ"
    assert a["sampled_global_rng"] == b["sampled_global_rng"] and len(a["sampled_global_rng"]) == 10, case
    # user generators seeded differently per rank: rank 0's draws decide on both
    assert a["sampled_generator"] == b["sampled_generator"], case
    if case in EP_CASES:  # exact logits: rank 0 samples what one process with the same seed samples
        assert a["sampled_generator"] == a["sampled_plain_seed7"], case


def test_adaptive_depth_is_rank_0s_choice(ranks):
    """Rank 1's own costs would stop every draft after step 1; rank 0's run every step. The
    ranks run rank 0's steps (more than 1 in some round), the same on both, and greedy output
    equals the unsharded model's (a step run on one rank only would hang the next collective)."""
    r0, r1 = ranks[0]["tp"], ranks[1]["tp"]
    assert r0["adaptive_steps"] == r1["adaptive_steps"]
    assert max(r1["adaptive_steps"]) > 1
    assert r0["adaptive_tokens"] == r1["adaptive_tokens"] == r0["adaptive_plain"]


def test_dspark_tree_size_is_rank_0s_choice(ranks):
    """Rank 1's cost table would cut every tree to its root; both ranks draft rank 0's full trees,
    and greedy output equals the unsharded model's."""
    r0, r1 = ranks[0]["tp"], ranks[1]["tp"]
    assert r0["dspark_sizes"] == r1["dspark_sizes"] and min(r0["dspark_sizes"]) == 8
    assert r0["dspark_tokens"] == r1["dspark_tokens"] == r0["dspark_plain"]


def test_sampled_dspark_trees_are_drawn_alike_on_every_rank(ranks):
    """A sampling run's drawn DSpark trees, each rank drawing from its own copy of one seed: the
    same trees on both ranks (verify's fingerprint check would raise otherwise), the same sizes
    (rank 0's budget) and the same sampled output."""
    r0, r1 = ranks[0]["tp"], ranks[1]["tp"]
    assert r0["dspark_sampled"] == r1["dspark_sampled"] and len(r0["dspark_sampled"]) > 0
    assert r0["dspark_sampled_nodes"] == r1["dspark_sampled_nodes"] and max(r0["dspark_sampled_nodes"]) > 1


def test_custom_generate_acceptance_is_rank_0s(ranks):
    """custom_generate on a sharded model: sampled rows identical on both ranks (their global
    RNGs differ), greedy with a length processor identical too although rank 1 asked for a
    different min_new_tokens, and equal to transformers' unsharded output for rank 0's."""
    r0, r1 = ranks[0]["tp"], ranks[1]["tp"]
    assert "hf_error" not in r0 and "hf_error" not in r1, (r0.get("hf_error"), r1.get("hf_error"))
    assert r0["hf_sampled"] == r1["hf_sampled"] and 60 < len(r0["hf_sampled"]) <= 60 + 10
    assert r0["hf_greedy"] == r1["hf_greedy"] == r0["hf_greedy_plain"]


def test_ranks_given_different_trees_or_prompts_fail_together(ranks):
    for r, res in enumerate(ranks):
        seen = res["tp"]["divergence"]
        assert seen["tree"] == "StateError" and seen["prompt"] == "StateError", f"{r=} {seen}"
        # the refused verify changed nothing: the request verifies again, same committed length
        assert seen["after_logits_shape"] == [2, 512] and seen["seq_len"] == 19, f"{r=} {seen}"


def test_cli_tp_and_ep_generate_the_single_process_tokens(ranks):
    plain = ranks[0]["cli_plain"].strip().splitlines()
    assert plain[0] == "rc=0"
    want = json.loads(plain[-1])["tokens"]
    assert len(want) == 8
    for key in ("cli_tp", "cli_ep"):
        lines = ranks[0][key].strip().splitlines()
        assert lines[0] == "rc=0" and json.loads(lines[-1])["tokens"] == want, f"{key}: {lines}"
        assert ranks[1][key].strip() == "rc=0", f"{key}: rank 1 prints nothing: {ranks[1][key]!r}"


# ---------------------------------------------------------------- refusals (no process group)
@pytest.fixture
def two_ranks_env(monkeypatch):
    for k, v in (("WORLD_SIZE", "2"), ("RANK", "0"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(k, v)


@pytest.mark.parametrize("kwargs,field", [
    (dict(tp_size=4), "tp_size=4"),
    (dict(tp_size=2, fsdp_size=2, ep_size=2), "fsdp_size"),
    (dict(tp_size=1, fsdp_size=2), "fsdp_size"),
    (dict(tp_size=2, pp_size=2), "pp_size"),
    (dict(tp_size=2, tp_plan={}), "tp_plan"),
    (dict(tp_size=2, tp_plan={"layers.*.self_attn.q_b_proj": "colwise"}), "tp_plan"),
    (dict(tp_size=2, ep_size=2, ep_plan={"layers.*.mlp.experts": "ep_dispatch_experts"}), "ep_plan"),
    (dict(tp_size=2, ep_size=2, ep_implementation="deepgemm_megamoe"), "ep_implementation"),
    (dict(tp_size=2, enable_sequence_parallel=True), "enable_sequence_parallel"),
])
def test_combinations_that_cannot_run_are_refused_before_loading(two_ranks_env, kwargs, field):
    with pytest.raises(InputError, match=field):
        dt.load_model(dt.tiny_checkpoint(), distributed_config=DistributedConfig(**kwargs))
    assert not torch.distributed.is_initialized()  # refused before transformers starts anything


def test_other_bad_distributed_arguments(two_ranks_env, monkeypatch):
    ckpt, cfg = dt.tiny_checkpoint(), DistributedConfig(tp_size=2)
    with pytest.raises(InputError, match="device='cpu'"):
        dt.load_model(ckpt, device="cpu", distributed_config=cfg)
    with pytest.raises(InputError, match="transformers.DistributedConfig"):
        dt.load_model(ckpt, distributed_config={"tp_size": 2})
    with pytest.raises(InputError, match="not to a built model"):
        dt.load_model(dt.load_model(ckpt).hf, distributed_config=cfg)
    if not torch.cuda.is_available():  # "keep" passes no device_map under a plan, but still needs CUDA
        with pytest.raises(InputError, match="CUDA device"):
            dt.load_model(dt.tiny_checkpoint(format="release"), quantized="keep", distributed_config=cfg)
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(InputError, match="torchrun"):
        dt.load_model(ckpt, distributed_config=cfg)
    assert not torch.distributed.is_initialized()


def test_cli_flags_map_to_distributed_configs(capsys, monkeypatch):
    cfg = distributed_config_for(ep=4, ep_implementation="all_to_all")
    assert (cfg.tp_size, cfg.ep_size, cfg.ep_implementation) == (4, 4, "all_to_all")
    assert (distributed_config_for(tp=2).tp_size, distributed_config_for(tp=2).ep_size) == (2, 1)
    assert distributed_config_for(tp=8, ep=8).ep_size == 8
    for kwargs, match in ((dict(tp=2, ep=4), "ep=4 needs tp=4"), (dict(tp=1), "tp must be an int >= 2"),
                          (dict(), "give tp or ep"), (dict(tp=2, ep_implementation="all_to_all"), "ep_implementation"),
                          (dict(ep=2, ep_implementation="nccl"), "ep_implementation")):
        with pytest.raises(InputError, match=match):
            distributed_config_for(**kwargs)
    from dsv4_tree.cli import main

    with pytest.raises(SystemExit) as exit_info:  # refused while parsing, before any work
        main(["generate", "--tp", "2", "--ep", "4"])
    assert exit_info.value.code == 2 and "--ep 4 needs --tp 4" in capsys.readouterr().err
    if "WORLD_SIZE" not in os.environ:
        assert main(["generate", "--tp", "2"]) == 2
        assert "torchrun" in capsys.readouterr().err
    # the launch command's --dtype (V4-Flash fits 8 ranks in bf16 only)
    import dsv4_tree.cli as cli

    loaded = []
    monkeypatch.setattr(cli, "load_model", lambda *a, **k: loaded.append(dt.load_model(*a, **k)) or loaded[-1])
    assert main(["generate", "--dtype", "bfloat16", "--max-new-tokens", "4", "--prompt-len", "16"]) == 0
    assert len(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tokens"]) == 4
    assert loaded[0].dtype == torch.bfloat16


def test_unsharded_models_issue_no_collective():
    model = dt.load_model(dt.tiny_checkpoint())
    assert model.ranks is None
    accs = [dt.Acceptance((0, 1), 5, 1, 1)]
    assert agree_acceptances(model, [dt.DraftTree.chain([1, 2])], accs) is accs
    check_same(model, [torch.tensor([1, 2])], "x")  # returns without a process group


def test_fingerprint_separates_trees_of_the_same_size():
    tree = torch.tensor([-1, 0, 0, 1])
    same = _fingerprint([[7], torch.tensor([4, 5, 6, 7]), tree])
    assert torch.equal(same, _fingerprint([[7], torch.tensor([4, 5, 6, 7]), tree.clone()]))
    for other in ([[7], torch.tensor([4, 5, 7, 6]), tree], [[7], torch.tensor([4, 5, 6, 7]), torch.tensor([-1, 0, 1, 1])],
                  [[8], torch.tensor([4, 5, 6, 7]), tree], [[7], torch.tensor([4, 5, 6]), tree[:3]]):
        assert not torch.equal(same, _fingerprint(other)), other


# ---------------------------------------------------------------- per-rank sizes (meta device)
def test_per_rank_sizes_follow_transformers_sharding():
    from dsv4_tree.checkpoint.tiny import RELEASE_TINY_OVERRIDES

    cfg = dt.tiny_config(**RELEASE_TINY_OVERRIDES)  # FP4 experts: TP 2 leaves 64 inputs, two groups of 32
    one, tp, ep = rank_size(cfg), rank_size(cfg, tp=2), rank_size(cfg, tp=2, ep=2)
    assert tp.parts["experts"] * 2 == one.parts["experts"] == ep.parts["experts"] * 2
    assert tp.parts["embed+head"] * 2 == one.parts["embed+head"]  # vocabulary 512 splits evenly
    assert tp.parts["rest"] == one.parts["rest"] == ep.parts["rest"]  # attention, norms, router: replicated
    assert tp.mtp == one.mtp and tp.total == sum(tp.parts.values())
    assert not torch.distributed.is_initialized()  # the fake process group is gone again
    with pytest.raises(InputError, match="ep 1 or tp"):
        rank_size(cfg, tp=2, ep=4)


def test_release_memory_prints_the_per_rank_table(tmp_path, capsys):
    import importlib.util

    from dsv4_tree.checkpoint.tiny import RELEASE_TINY_OVERRIDES

    config = tmp_path / "config.json"
    dt.tiny_config(**RELEASE_TINY_OVERRIDES).to_json_file(str(config))
    spec = importlib.util.spec_from_file_location("release_memory", TESTS.parent / "benchmarks" / "release_memory.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--config", str(config), "--tp", "2", "--ep", "2"])
    lines = capsys.readouterr().out.strip().splitlines()
    table = json.loads(lines[-1])["per_rank_bytes"]
    assert list(table) == ["1", "TP 2", "EP 2 (tp=ep)"] and any(line.startswith("TP 2 ") for line in lines)
    want = rank_size(dt.tiny_config(**RELEASE_TINY_OVERRIDES), tp=2)
    assert table["TP 2"][:4] == [want.parts["experts"], want.parts["embed+head"], want.parts["rest"], want.total]
    assert table["TP 2"][4] == want.total + want.mtp.file_bytes and table["1"][0] == 2 * table["TP 2"][0]
