"""The command line: demo (checked per path), generate, errors and help."""
import json
import re
import subprocess
import sys

import pytest

from dsv4_tree.cli import main


@pytest.fixture(scope="module")
def demo_out():
    """What `dsv4-tree demo` (./scripts/demo, the README's quick start) prints, at 2 rounds."""
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()) as buf:
        assert main(["demo", "--rounds", "2", "--prompt-len", "40"]) == 0
    return buf.getvalue()


def test_the_readmes_demo_lines_have_the_demos_fields_in_order(demo_out):
    """Every output line the README shows for the demo (its `text` blocks' `rounds:` / `compare:`
    lines) has the structure a run prints: the same fields in the same order, numbers aside."""
    from doc_blocks import ROOT, blocks, output_skeleton

    shown = [line for b in blocks(ROOT / "README.md") if b.label == "text" for line in b.code.split("\n")
             if line.startswith(("rounds:", "compare:"))]
    assert {line.split(":")[0] for line in shown} == {"rounds", "compare"}, shown
    printed = {output_skeleton(line) for line in demo_out.splitlines() if line.startswith(("rounds:", "compare:"))}
    for line in shown:
        assert output_skeleton(line) in printed, f"README: {line!r}\nthe demo prints: {sorted(printed)}"


def test_demo_chain_and_tree(demo_out, capsys):
    """Default: the shipped trained checkpoint with its MTP drafter, as a chain and as a tree,
    ending with one comparison line; spec flags select one mode."""
    out = demo_out
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
    from dsv4_tree.cli import _prompt
    from dsv4_tree.drafters.base import default_tree_nodes
    from test_generate import hf_greedy

    assert main(["generate", "--max-new-tokens", "12", "--topk", "2", "--num-steps", "3", "--drafter", "mtp"]) == 0
    out = capsys.readouterr().out
    data = json.loads(out.strip().splitlines()[-1])
    # nodes verified per request-round (root included): the JSON's list, its mean in the summary line
    assert len(data["round_nodes"]) == data["rounds"] and all(1 <= n <= 8 for n in data["round_nodes"])
    mean_nodes = sum(data["round_nodes"]) / data["rounds"]
    assert data["mean_nodes_per_round"] == pytest.approx(mean_nodes)
    assert f"{mean_nodes:.2f} nodes verified per round (root included)" in next(
        line for line in out.splitlines() if line.startswith("generated "))
    assert f"nodes {mean_nodes:.2f} per request-round" in out
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


@pytest.fixture()
def no_work(monkeypatch):
    """Every command replaced by a failure: what exits 2 here was refused before any work."""
    import dsv4_tree.cli as cli
    import dsv4_tree.cli_train as cli_train

    def ran(args):
        raise AssertionError(f"{args.command} ran past the argument checks")

    for name in ("cmd_demo", "cmd_generate"):
        monkeypatch.setattr(cli, name, ran)
    for name in ("cmd_train_tiny", "cmd_train_dspark"):
        monkeypatch.setattr(cli_train, name, ran)


@pytest.mark.parametrize("argv,flag,why", [
    (["demo", "--seed", str(10**25)], "--seed", "in [0, 9223372036854775807]"),
    (["generate", "--seed", "-1"], "--seed", "in [0,"),
    (["demo", "--tensors-out", "no-such-dir/sub/t.pt"], "--tensors-out", "'no-such-dir/sub' does not exist"),
    (["demo", "--tensors-out", "."], "--tensors-out", "is a directory"),
    (["train-tiny", "--out", "ck", "--max-files", "1"], "--max-files", "training split holds 0 bytes"),
    (["train-tiny", "--out", "ck", "--max-files", "2"], "--max-files", "max_files >= 3 works"),
    (["generate", "--ep-implementation", "all_to_all"], "--ep-implementation", "give --ep N too"),
    (["generate", "--tp", "2", "--ep-implementation", "all_reduce"], "--ep-implementation", "give --ep N too"),
    (["generate", "--tp", "2", "--ep", "4"], "--ep 4 needs --tp 4", "ep_size == tp_size"),
    (["generate", "--tp", "1"], "--tp", "must be >= 2"),
    (["train-tiny", "--out", "ck", "--lr", "inf"], "--lr", "finite"),
    (["train-tiny", "--out", "ck", "--lr", "nan"], "--lr", "finite"),
    (["demo", "--temperature", "inf"], "--temperature", "finite"),
    (["demo", "--prompt-text", ""], "--prompt-text", "at least one character"),
    (["generate", "--prompt-text", ""], "--prompt-text", "at least one character"),
    (["generate", "--prompt", ""], "--prompt", "comma-separated integer token ids"),
    (["generate", "--prompt=-1,2"], "--prompt", "must be >= 0"),
    (["generate", "--prompt", "1,2", "--prompt-text", "ab"], "--prompt-text", "give one"),
])
def test_bad_values_are_refused_before_any_work(argv, flag, why, no_work, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and flag in err and why in err and "Traceback" not in err, err


@pytest.mark.parametrize("content,why", [
    (None, "not a readable UTF-8 TOML file"),  # a directory
    (b"spec = 3\n", "'spec' must be a table of SpecConfig fields ([spec]), got int 3"),
    (b"\xff\xfe eagle_topk = 4\n", "not a readable UTF-8 TOML file"),
    (b'eagle_topk = "four"\n', "SpecConfig.eagle_topk must be an int"),  # read, then checked as SpecConfig(**fields)
])
def test_a_bad_spec_file_is_refused_naming_the_flag(content, why, no_work, capsys, tmp_path):
    import dsv4_tree as dt

    path = tmp_path / "preset.toml"
    path.mkdir() if content is None else path.write_bytes(content)
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--spec", str(path)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "argument --spec" in err and why in err and "Traceback" not in err, err
    with pytest.raises(dt.ConfigError, match=re.escape(why)):  # the library says the same
        dt.SpecConfig.from_file(path)


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
    """dsv4_tree errors raised while the engine is set up exit 2 with their message, no traceback."""
    assert main(["demo", "--topk", "2", "--num-steps", "2", "--num-draft-tokens", "50"]) == 2
    assert "ConfigError" in capsys.readouterr().err
    for command in ("demo", "generate"):  # eagle_topk above the shipped checkpoint's 260-token vocabulary
        assert main([command, "--topk", "300", "--num-steps", "2", "--num-draft-tokens", "8", "--drafter", "mtp"]) == 2
        err = capsys.readouterr().err
        assert "ConfigError: SpecConfig.eagle_topk=300 exceeds" in err and "Traceback" not in err, err


def test_help_explains_flags():
    out = subprocess.run([sys.executable, "-m", "dsv4_tree.cli", "demo", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for flag in ("--topk", "--num-steps", "--num-draft-tokens", "--rounds", "--checkpoint", "--spec"):
        assert flag in out.stdout
