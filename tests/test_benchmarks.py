"""Benchmarks run without the optional `bench` extra: plotting is skipped with a one-line
note and the JSON line is still printed last."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Makes matplotlib uninstalled in the child: every finder returns nothing for it.
BLOCK_AND_RUN = r"""
import runpy, sys
class Blocked:
    def __init__(self, finder):
        self.finder = finder
    def find_spec(self, name, path=None, target=None):
        if name == "matplotlib" or name.startswith("matplotlib."):
            return None
        return self.finder.find_spec(name, path, target)
    def __getattr__(self, attr):
        return getattr(self.finder, attr)
sys.meta_path[:] = [Blocked(f) if hasattr(f, "find_spec") else f for f in sys.meta_path]
script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
"""


def test_bench_verify_without_matplotlib(tmp_path):
    png = tmp_path / "plot.png"
    args = ["benchmarks/bench_verify.py", "--quick", "--shapes", "tiny", "--contexts", "64", "--nodes", "2",
            "--layers", "3", "--plot", str(png)]
    # the malloc variables are what the script would re-exec itself with (that would drop the blocker)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    out = subprocess.run([sys.executable, "-c", BLOCK_AND_RUN, *args], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    notes = [line for line in lines if line.startswith("plot:")]
    assert len(notes) == 1 and "matplotlib is not installed" in notes[0], lines
    assert not png.exists()
    data = json.loads(lines[-1])
    assert data["context"] == 64 and data["N"] == 2 and len(data["records"]) == 1, data
