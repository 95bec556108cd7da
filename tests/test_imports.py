"""Importing from the repository root: the root `kernels/` folder is importable there as a
top-level `kernels` package, which transformers probes for Hugging Face's own `kernels`
package. It must import nothing heavy until a kernel is used, so neither `import dsv4_tree`
nor `import transformers` depends on (or pays for) Triton because of it."""
import json
import subprocess
import sys
from pathlib import Path

from child_blocker import blocker_source


ROOT = Path(__file__).resolve().parents[1]

# Runs in a fresh interpreter started at the repository root (`python -c`, so the root is on
# sys.path, as in notebooks and `python -m` there). BLOCK=1 makes Triton uninstalled: every
# finder returns nothing for it, so `import triton` raises ModuleNotFoundError and
# importlib.util.find_spec("triton") is None. Every Triton lookup records whether a frame of
# this project's code was on the stack.
PROBE = r"""
import json, os, sys, traceback""" + blocker_source("triton") + r"""
ROOT = os.getcwd()
OURS = (os.path.join(ROOT, "kernels") + os.sep, os.path.join(ROOT, "dsv4_tree") + os.sep)
BLOCK = os.environ["DSV4_TREE_TEST_BLOCK_TRITON"] == "1"
ours_imported_triton = []

class Tracer:
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            frames = [f.filename for f in traceback.extract_stack()]
            if any(f.startswith(OURS) for f in frames):
                ours_imported_triton.append(name)
        return None

if BLOCK:
    block()
sys.meta_path.insert(0, Tracer())

import transformers
from transformers import DeepseekV4ForCausalLM  # loads the model code, which probes `kernels`
import dsv4_tree as dt
import kernels  # what the probe found: the root folder

root_kernels = os.path.realpath(kernels.__file__).startswith(ROOT)
submodules = sorted(m for m in sys.modules if m.startswith(("kernels.", "dsv4_tree.kernels.")))
result = dict(ours_imported_triton=ours_imported_triton, root_kernels=root_kernels, submodules=submodules,
              triton_loaded="triton" in sys.modules)
engine = dt.Engine(dt.load_model(dt.tiny_checkpoint()))
result["prefill_seq_len"] = engine.prefill([5, 6, 7, 8]).seq_len
try:
    dt.Engine(engine.model, dt.SpecConfig(attention_backend="triton"))
    result["triton_backend"] = "ok"
except dt.ConfigError as exc:
    result["triton_backend"] = "ConfigError: " + str(exc)
print(json.dumps(result))
"""


def run_probe(block: bool) -> dict:
    env = {k: v for k, v in __import__("os").environ.items() if k != "PYTHONPATH"}
    env["DSV4_TREE_TEST_BLOCK_TRITON"] = "1" if block else "0"
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, f"{block=}\n{out.stderr[-3000:]}"
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_at_repo_root_with_triton_installed():
    res = run_probe(block=False)
    assert res["root_kernels"], res  # the probe really found the root folder
    assert res["ours_imported_triton"] == [], res  # no Triton import came from our code
    assert res["submodules"] == [], res  # no kernel module loaded before use
    assert res["prefill_seq_len"] == 3 and res["triton_backend"] == "ok", res


def test_import_at_repo_root_without_triton():
    res = run_probe(block=True)
    assert res["root_kernels"], res
    assert not res["triton_loaded"] and res["submodules"] == [], res
    assert res["prefill_seq_len"] == 3, res  # the torch backend works without Triton
    assert res["triton_backend"].startswith("ConfigError") and "triton" in res["triton_backend"], res
