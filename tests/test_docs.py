"""The README and docs/ as a user reads them: every link resolves, every python block runs,
every shell command parses with the program it names, and the CLI synopsis lists exactly the
flags the parser has. A renamed function, flag, file or heading fails here.

Blocks are labelled python, bash or text (text: program output, synopses, layouts; never run).
Python blocks of one page run in order in one namespace, as a reader runs the page. What a
reader's machine has and this one lacks is replaced before they run (SUBSTITUTE); the API calls
stay as written. Shell commands are parsed, not run (the programs they name are tested
elsewhere): the program's own argparse parser reads the documented arguments and stops."""
import argparse
import contextlib
import importlib.util
import io
import re
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from doc_blocks import DOC_FILES, LABELS, LINKED_FILES, ROOT, all_blocks, anchors, blocks, links, shell_commands

# what the reader brings, by page: a released V4 directory becomes a shipped checkpoint in the
# same layout, a GPU becomes the CPU (fp32), `prompt_ids` is a short byte prompt
V4_DIR = '"/models/DeepSeek-V4-Flash"'
SUBSTITUTE = {
    "docs/release-checkpoints.md": {V4_DIR: 'str(dt.tiny_checkpoint(format="release"))'},
    "docs/dspark.md": {V4_DIR: "str(dt.trained_checkpoint())"},
    "*": {'device="cuda"': 'device="cpu"', "torch.bfloat16": "torch.float32"},
}
PROMPT = "prompt_ids = list(b'def parse(text):\\n    ')\n"


def _page(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_every_block_is_labelled():
    bad = [f"{b.where}: {b.label!r}" for b in all_blocks() if b.label not in LABELS]
    assert not bad, f"label each block one of {LABELS}:\n" + "\n".join(bad)


def test_readme_is_a_front_page():
    n = len((ROOT / "README.md").read_text().split("\n"))
    assert n <= 160, f"README.md has {n} lines: the manual belongs in docs/"


def test_every_link_resolves():
    bad = []
    for path in LINKED_FILES:
        for line, target in links(path):
            if re.match(r"[a-z]+:", target):  # http(s), mailto: not checked offline
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                bad.append(f"{_page(path)}:{line}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{_page(path)}:{line}: {target} (no heading #{anchor} in {dest.name})")
    assert not bad, "\n".join(bad)


PATH_IN_TICKS = re.compile(r"`((?:dsv4_tree|kernels|tests|benchmarks|scripts|configs|design_notes|docs|examples)/"
                           r"[\w./-]*\w)(?:::[\w\[\]-]+)?`")


def test_every_named_repository_path_exists():
    """`dsv4_tree/...`, `tests/...`, `scripts/...` paths named in backticks exist (a moved file
    leaves no stale name behind)."""
    bad = []
    for path in LINKED_FILES:
        for i, line in enumerate(path.read_text().split("\n"), 1):
            for m in PATH_IN_TICKS.finditer(line):
                name = m.group(1)
                if "*" in name or not (ROOT / name).exists():
                    if not any((ROOT / name).parent.glob(Path(name).name)):
                        bad.append(f"{_page(path)}:{i}: {name}")
    assert not bad, "\n".join(bad)


def _python_pages():
    return sorted({b.path for b in all_blocks("python")})


@pytest.mark.parametrize("path", _python_pages(), ids=_page)
def test_python_blocks_run(path, capsys):
    torch.manual_seed(0)
    subs = {**SUBSTITUTE["*"], **SUBSTITUTE.get(_page(path), {})}
    namespace = {"__name__": "__doc_page__"}
    exec(PROMPT, namespace)
    for block in blocks(path):
        if block.label != "python":
            continue
        code = block.code
        for old, new in subs.items():
            code = code.replace(old, new)
        try:
            exec(compile(code, block.where, "exec"), namespace)
        except Exception as exc:
            raise AssertionError(f"{block.where} failed as written (after {subs}): {exc!r}") from exc


class _Parsed(Exception):
    """Raised by the patched parse_args once the documented arguments have parsed."""


@contextlib.contextmanager
def _parse_only():
    real = argparse.ArgumentParser.parse_args

    def parse_args(self, args=None, namespace=None):
        real(self, args, namespace)  # exits 2 on a bad flag or value
        raise _Parsed

    argparse.ArgumentParser.parse_args = parse_args
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args = real


def _main_of(path: Path):
    spec = importlib.util.spec_from_file_location(f"_doc_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main


def _cli_main():
    from dsv4_tree.cli import main

    return main


def _program(words: list):
    """(main, argv) of a documented command, or None for a command run by another suite."""
    if words[0] == "torchrun":
        words = words[words.index("-m") + 1:]
        assert words[0] == "dsv4_tree.cli", words
        return _cli_main(), words[1:]
    if words[:2] == ["python", "-m"] and words[2] == "dsv4_tree.cli":
        return _cli_main(), words[3:]
    if words[0] == "dsv4-tree":
        return _cli_main(), words[1:]
    if words[0] == "./scripts/demo":
        assert (ROOT / "scripts/demo").read_text().rstrip().endswith('exec dsv4-tree demo "$@"')
        return _cli_main(), ["demo", *words[1:]]
    if words[:2] == ["bash", "scripts/gpu_check"]:
        assert (ROOT / "scripts/gpu_check").read_text().rstrip().endswith('scripts/gpu_check.py" --python "$PY" "$@"')
        return _main_of(ROOT / "scripts/gpu_check.py"), ["--python", sys.executable, *words[2:]]
    if words[:2] == ["bash", "scripts/aot_gate"]:
        assert (ROOT / "scripts/aot_gate").read_text().rstrip().endswith('exec python -m dsv4_tree.aot "$@"')
        from dsv4_tree.aot.__main__ import main

        return main, words[2:]
    if words[0] == "python" and words[1].endswith(".py"):
        return _main_of(ROOT / words[1]), words[2:]
    return None


def _shell_cases():
    cases = []
    for block in all_blocks("bash"):
        for words, env in shell_commands(block):
            cases.append(pytest.param(words, env, id=f"{block.where}:{words[0]}"))
    return cases


@pytest.mark.parametrize("words,env", _shell_cases())
def test_shell_commands_parse(words, env):
    if words == ["./scripts/test"]:  # the suite itself: what CI runs
        assert (ROOT / ".ci/run").read_text().rstrip().endswith("./scripts/test")
        return
    if words[:2] == ["pip", "install"]:  # an extra of this package, or a named package
        extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
        for spec in words[2:]:
            m = re.fullmatch(r"dsv4-tree\[([\w,]+)\]", spec)
            assert m and set(m.group(1).split(",")) <= set(extras), f"{spec}: extras are {sorted(extras)}"
        return
    if words[:3] == ["python", "-m", "sglang.launch_server"]:
        # resolved with SGLang's own arguments and the plug-in in the SGLang suite
        # (tests/with_sglang/test_doc_launches.py)
        assert env.get("SGLANG_PLUGINS") == "dsv4_tree", words
        return
    program = _program(words)
    assert program is not None, f"a documented command no test reads: {words}"
    main, argv = program
    with _parse_only(), pytest.raises(_Parsed), contextlib.redirect_stderr(io.StringIO()) as err:
        try:
            main(argv)
        except SystemExit as exc:
            raise AssertionError(f"{words}: the parser refused it ({exc.code}): {err.getvalue()}") from exc


def _synopsis_flags():
    text = next(b for b in blocks(ROOT / "docs/cli.md") if b.label == "text").code
    by_command, command = {}, None
    for line in text.split("\n"):
        m = re.match(r"dsv4-tree (\S+)", line)
        if m:
            command = m.group(1)
        if command:
            by_command.setdefault(command, set()).update(re.findall(r"(--[\w-]+)", line))
    return by_command


def test_cli_synopsis_lists_exactly_the_parsers_flags():
    from dsv4_tree.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    documented = _synopsis_flags()
    assert set(documented) == set(sub.choices), f"commands: docs {sorted(documented)}, parser {sorted(sub.choices)}"
    for name, parser in sub.choices.items():
        flags = {o for a in parser._actions for o in a.option_strings if o.startswith("--") and o != "--help"}
        assert documented[name] == flags, (f"dsv4-tree {name}: only in docs/cli.md {sorted(documented[name] - flags)}, "
                                           f"only in the parser {sorted(flags - documented[name])}")


def test_every_doc_page_is_in_the_index():
    index = (ROOT / "docs/README.md").read_text()
    missing = [p.name for p in DOC_FILES[1:] if p.name != "README.md" and f"]({p.name})" not in index]
    assert not missing, f"docs/README.md does not list {missing}"
    notes = (ROOT / "design_notes/README.md").read_text()
    missing = [p.name for p in sorted((ROOT / "design_notes").glob("*.md"))
               if p.name != "README.md" and f"]({p.name})" not in notes]
    assert not missing, f"design_notes/README.md does not list {missing}"
