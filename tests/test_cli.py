"""The command line: demo (checked per path), generate, errors and help."""
import json
import subprocess
import sys

import pytest

from dsv4_tree.cli import main


def test_demo_chain_and_tree(capsys):
    """Default: the shipped trained checkpoint with its MTP drafter, as a chain and as a tree,
    ending with one comparison line; spec flags select one mode."""
    assert main(["demo", "--rounds", "2", "--prompt-len", "40"]) == 0
    out = capsys.readouterr().out
    assert "rel_err" in out and "tiny-stdlib-bytes" in out and "continuation:" in out
    assert "topk=1 num_steps=3 num_draft_tokens=4 draft_depth=fixed" in out
    assert "topk=4 num_steps=5 num_draft_tokens=8 draft_depth=adaptive" in out  # the preset tree
    assert out.count("rounds: draft steps") == 2 and "of 5 per round" in out and "calibration by depth" in out
    last = out.strip().splitlines()[-1]
    assert last.startswith("compare: chain (topk=1 N=4)") and "| tree (topk=4 N=8)" in last
    assert last.count("PASS") == 2 and last.count("tokens/verify") == 2 and last.count("tokens/s") == 2
    assert main(["demo", "--rounds", "2", "--prompt-len", "30", "--topk", "3", "--num-steps", "4",
                 "--num-draft-tokens", "10"]) == 0
    out = capsys.readouterr().out
    assert "topk=3 num_steps=4 num_draft_tokens=10" in out and "PASS" in out
    assert "topk=1 num_steps=3" not in out and out.count("summary:") == 1


def test_demo_on_random_checkpoint_with_planted_drafter(capsys):
    import dsv4_tree as dt

    assert main(["demo", "--checkpoint", str(dt.tiny_checkpoint()), "--drafter", "planted", "--rounds", "2",
                 "--prompt-len", "30", "--topk", "2", "--num-steps", "3"]) == 0
    assert "PASS" in capsys.readouterr().out


def test_generate_prints_stats_and_json(capsys):
    import dsv4_tree as dt
    from dsv4_tree.cli import _prompt, default_tree_nodes
    from test_generate import hf_greedy

    assert main(["generate", "--max-new-tokens", "12", "--topk", "2", "--num-steps", "3", "--drafter", "mtp"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    data = json.loads(last)
    model = dt.load_model(dt.trained_checkpoint())
    ids = _prompt(model, 64, 0)  # the command's default prompt (--prompt-len 64, --seed 0)
    assert data["tokens"] == hf_greedy(model, ids, 12)  # greedy speculation: the model's own greedy tokens
    assert data["rounds"] == sum(data["histogram"].values())
    assert len(data["draft_steps"]) == data["rounds"] and 1 <= min(data["draft_steps"]) <= max(data["draft_steps"]) <= 3
    assert data["steps_allowed"] == 3
    assert sum(int(k) * v for k, v in data["histogram"].items()) == 12
    assert default_tree_nodes(2, 3) == 8


@pytest.mark.parametrize("argv,flag", [
    (["demo", "--rounds", "0"], "--rounds"), (["demo", "--threads", "-1"], "--threads"),
    (["generate", "--threads", "-2"], "--threads"), (["generate", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["demo", "--topk", "0"], "--topk"), (["demo", "--top-p", "1.5"], "--top-p"),
    (["demo", "--corrupt", "2"], "--corrupt"), (["generate", "--mask-mode", "FULL_MASK"], "--mask-mode"),
    (["demo", "--mask-mode", "FULL_MASK"], "--tensors-out"), (["demo", "--prompt-len", "1"], "--prompt-len"),
])
def test_bad_flag_values_exit_2_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and "usage:" in err, err


def test_flags_apply_on_top_of_a_preset():
    from dsv4_tree.cli import _spec, build_parser

    def spec(*argv):
        return _spec(build_parser().parse_args(["demo", *argv]))

    preset = dt_spec("configs/tree_topk4.toml")
    s = spec("--spec", "configs/tree_topk4.toml", "--num-steps", "3")
    assert (s.eagle_topk, s.num_steps, s.num_draft_tokens) == (preset.eagle_topk, 3, preset.num_draft_tokens)
    s = spec("--spec", "configs/tree_topk4.toml", "--topk", "2")
    assert (s.eagle_topk, s.num_steps, s.num_draft_tokens) == (2, preset.num_steps, preset.num_draft_tokens)
    s = spec("--spec", "configs/tree_topk4.toml", "--num-draft-tokens", "6")
    assert s.num_draft_tokens == 6 and s.eagle_topk == preset.eagle_topk
    assert spec("--num-steps", "5").num_draft_tokens == 6  # a chain: num_steps + 1
    assert spec("--topk", "4", "--num-steps", "5").num_draft_tokens == 14  # chain made a tree: the stated default


def dt_spec(path):
    import dsv4_tree as dt

    return dt.SpecConfig.from_file(path)


def test_bad_config_is_a_clean_error(capsys):
    assert main(["demo", "--topk", "2", "--num-steps", "2", "--num-draft-tokens", "50"]) == 2
    assert "ConfigError" in capsys.readouterr().err


def test_help_explains_flags():
    out = subprocess.run([sys.executable, "-m", "dsv4_tree.cli", "demo", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for flag in ("--topk", "--num-steps", "--num-draft-tokens", "--rounds", "--checkpoint", "--spec"):
        assert flag in out.stdout
