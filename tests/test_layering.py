"""design_notes/package-layout.md as a test: no import cycle between modules of `dsv4_tree` (the
root `kernels/` folder included, as it installs), no import against the documented layer order,
none of the documented forbidden imports. The graph is read with `ast`, so an import inside a
function counts as much as one at the top. The checker is also run on small planted packages,
which it must refuse, so a checker that finds nothing cannot pass."""
import re
from pathlib import Path

import pytest

from import_graph import cycles, import_graph, package_files

ROOT = Path(__file__).resolve().parents[1]
LAYOUT = ROOT / "design_notes" / "package-layout.md"
FOLDERS = {"dsv4_tree": "dsv4_tree", "kernels": "dsv4_tree.kernels"}


def section(text: str, title: str) -> str:
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, f"{LAYOUT.name} has no '## {title}' section"
    return match.group(1)


def unit_name(ticked: str) -> str:
    return ticked.removesuffix("/").removesuffix(".py")


def documented_layers(text: str) -> dict[str, int]:
    """unit -> layer number, from the numbered list of '## Layer order' (the backticked names
    before each item's first colon)."""
    layers = {}
    for number, body in re.findall(r"^(\d+)\. (.*?)(?=^\d+\. |\Z)", section(text, "Layer order"), re.S | re.M):
        for name in re.findall(r"`([^`]+)`", body.split(":", 1)[0]):
            assert unit_name(name) not in layers, f"{name} is listed twice"
            layers[unit_name(name)] = int(number)
    return layers


def documented_rules(text: str) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(unit -> units it never imports, unit -> the only units that may import it)."""
    never, only = {}, {}
    for line in re.findall(r"^\* (.*?)(?=^\* |^\n|\Z)", section(text, "Imports that skip layers but are still refused"),
                           re.S | re.M):
        head, _, tail = line.partition(":")
        names = [unit_name(n) for n in re.findall(r"`([^`]+)`", head)]
        if " never imports " in head:
            never[names[0]] = set(names[1:])
        elif " is imported only by " in head:
            only[names[0]] = set(names[1:])
        else:
            raise AssertionError(f"unreadable rule in {LAYOUT.name}: {line!r}")
    return never, only


def unit_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def violations(graph: dict[str, set[str]], layers: dict[str, int], never: dict[str, set[str]],
               only: dict[str, set[str]]) -> list[str]:
    bad = [f"import cycle: {' <-> '.join(c)}" for c in cycles(graph)]
    for unit in sorted({unit_of(m) for m in graph} - set(layers)):
        bad.append(f"dsv4_tree.{unit} is on no layer of {LAYOUT.name}")
    for module, deps in sorted(graph.items()):
        mine = unit_of(module)
        for dep in sorted(deps):
            theirs = unit_of(dep)
            if theirs == mine or mine not in layers or theirs not in layers:
                continue
            if layers[theirs] >= layers[mine]:
                bad.append(f"{module} (layer {layers[mine]}) imports {dep} (layer {layers[theirs]})")
            if theirs in never.get(mine, ()):
                bad.append(f"{module} imports {dep}: {mine} never imports {theirs}")
            if theirs in only and mine not in only[theirs]:
                bad.append(f"{module} imports {dep}: only {sorted(only[theirs])} import {theirs}")
    return bad


def test_package_follows_its_documented_layers():
    text = LAYOUT.read_text()
    graph = import_graph(package_files(ROOT, FOLDERS))
    assert len(graph) > 100 and sum(map(len, graph.values())) > 300  # the walk really found the package
    bad = violations(graph, documented_layers(text), *documented_rules(text))
    assert not bad, "\n".join(bad)


def test_every_documented_unit_exists():
    """A unit renamed or removed leaves no stale line in the layer order."""
    present = {unit_of(m) for m in package_files(ROOT, FOLDERS)}
    text = LAYOUT.read_text()
    never, only = documented_rules(text)
    named = set(documented_layers(text)) | set(never) | set(only)
    named |= {u for rule in (*never.values(), *only.values()) for u in rule}
    assert named <= present, sorted(named - present)


def _plant(tmp_path: Path, sources: dict[str, str]) -> dict[str, set[str]]:
    for rel, source in sources.items():
        path = tmp_path / "dsv4_tree" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    return import_graph(package_files(tmp_path, {"dsv4_tree": "dsv4_tree"}))


PLANTED_LAYERS = {"__init__": 3, "errors": 1, "checkpoint": 2, "serving": 2, "reference": 1}


@pytest.mark.parametrize("case", ["module_cycle", "three_module_cycle", "function_level_cycle", "upward",
                                  "same_layer", "never", "only", "unlisted"])
def test_checker_refuses_planted_faults(tmp_path, case):
    """Each planted package breaks one rule; the checker names that fault. The first two are
    the shapes of the two cycles the package once had (checkpoint/dspark <-> checkpoint/mtp through
    `from .mtp import ...`; release -> dspark_names -> tiny -> release)."""
    base = {"__init__.py": "", "errors.py": "", "checkpoint/__init__.py": "", "serving/__init__.py": "",
            "reference/__init__.py": ""}
    plant = {
        "module_cycle": {"checkpoint/dspark.py": "from .mtp import mtp_config\n",
                         "checkpoint/mtp.py": "from .dspark import DSPARK_KEYS\n"},
        "three_module_cycle": {"checkpoint/release.py": "from . import dspark_names\n",
                               "checkpoint/dspark_names.py": "from .tiny import write\n",
                               "checkpoint/tiny.py": "from dsv4_tree.checkpoint.release import write_release\n"},
        "function_level_cycle": {"checkpoint/a.py": "def f():\n    from . import b\n",
                                 "checkpoint/b.py": "import dsv4_tree.checkpoint.a\n"},
        "upward": {"errors.py": "from .checkpoint import files\n", "checkpoint/files.py": ""},
        "same_layer": {"serving/pool.py": "from ..checkpoint import files\n", "checkpoint/files.py": ""},
        "never": {"serving/pool.py": "from ..errors import StateError\nfrom .. import errors\n"},
        "only": {"checkpoint/x.py": "from ..reference import per_path\n", "reference/per_path.py": ""},
        "unlisted": {"newthing.py": "from . import errors\n"},
    }[case]
    graph = _plant(tmp_path, {**base, **plant})
    never = {"serving": {"errors"}} if case == "never" else {}
    only = {"reference": {"__init__"}}
    found = violations(graph, PLANTED_LAYERS, never, only)
    expect = {"module_cycle": "import cycle: dsv4_tree.checkpoint.dspark <-> dsv4_tree.checkpoint.mtp",
              "three_module_cycle": "import cycle: dsv4_tree.checkpoint.dspark_names <-> "
                                    "dsv4_tree.checkpoint.release <-> dsv4_tree.checkpoint.tiny",
              "function_level_cycle": "import cycle: dsv4_tree.checkpoint.a <-> dsv4_tree.checkpoint.b",
              "upward": "dsv4_tree.errors (layer 1) imports dsv4_tree.checkpoint.files (layer 2)",
              "same_layer": "dsv4_tree.serving.pool (layer 2) imports dsv4_tree.checkpoint.files (layer 2)",
              "never": "dsv4_tree.serving.pool imports dsv4_tree.errors: serving never imports errors",
              "only": "dsv4_tree.checkpoint.x imports dsv4_tree.reference.per_path: only ['__init__'] import reference",
              "unlisted": "dsv4_tree.newthing is on no layer of package-layout.md"}[case]
    assert found == [expect], found


def test_layout_rules_parse():
    """The documented rules are read as meant: every layer's names, and each refusal."""
    text = LAYOUT.read_text()
    layers = documented_layers(text)
    assert layers["errors"] == 1 and layers["engine"] > layers["generate_batch"] > layers["drafters"]
    assert layers["serving"] < layers["attention"] < layers["executor"]
    never, only = documented_rules(text)
    assert never["serving"] == {"model", "checkpoint", "hf_bindings"}
    assert only["reference"] == {"cli", "__init__"}
