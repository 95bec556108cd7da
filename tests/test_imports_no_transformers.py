"""Without the `hf` extra: the trees, the serving tables, the references, the kernels and the
SGLang plug-in import with transformers uninstalled (a user of SGLang has transformers 5.19.0,
not our oracle's 5.23.0), and none of them imports transformers when it is installed. The
Hugging Face engine names load on first use and need it."""
import json
import subprocess
import sys
from pathlib import Path

from child_blocker import blocker_source

ROOT = Path(__file__).resolve().parents[1]

PROBE = r"""
import importlib, json, sys""" + blocker_source("transformers") + r"""
if sys.argv[1] == "1":
    block()
mods = ["dsv4_tree", "dsv4_tree.tree", "dsv4_tree.serving", "dsv4_tree.serving.tables", "dsv4_tree.serving.swa_table",
        "dsv4_tree.reference", "dsv4_tree.kernels", "dsv4_tree.sglang_plugin", "dsv4_tree.sglang_plugin.tables",
        "dsv4_tree.sglang_plugin.draft_tables", "dsv4_tree.sglang_plugin.branch_candidates",
        "dsv4_tree.sglang_plugin.validate", "dsv4_tree.verify", "dsv4_tree.errors"]
for m in mods:
    importlib.import_module(m)
import dsv4_tree
res = {"transformers_loaded": "transformers" in sys.modules, "sglang_loaded": "sglang" in sys.modules}
try:
    dsv4_tree.Engine
    res["engine"] = "ok"
except ModuleNotFoundError as exc:
    res["engine"] = "ModuleNotFoundError: " + exc.name
print(json.dumps(res))
"""


def run(block: bool) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, "1" if block else "0"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_torch_only_modules_import_without_transformers():
    res = run(block=True)
    assert res == {"transformers_loaded": False, "sglang_loaded": False,
                   "engine": "ModuleNotFoundError: transformers"}, res


def test_torch_only_modules_do_not_load_transformers():
    res = run(block=False)
    assert res == {"transformers_loaded": False, "sglang_loaded": False, "engine": "ok"}, res
