"""GPU installs resolve: every CUDA torch the project supports, with the Triton its wheel requires,
is admitted by the project's own requirements (design_notes/triton-versions.md).

CPU torch wheels require no Triton, so the CPU environments never meet this; a CUDA torch on
Linux x86_64 pins its Triton exactly, and `pip install "dsv4-tree[triton]"` beside it resolves
only when the `triton` extra admits that pin. The test reads each CUDA wheel's own metadata with
pip's resolver report (`--dry-run --report`, metadata only: no multi-GB download), from the
package index alone (`--isolated`: no local find-links, where a CPU build of the same version may
lie), and reads the Triton release that requirement resolves to the same way. Without the index
it skips, saying so."""
from __future__ import annotations

import functools
import json
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
# the CUDA torches users bring: common CUDA images (2.11), the CPU suite's version (2.13), SGLang
# 0.5.23's pin (2.14.1); docs/install.md lists the same
SUPPORTED_TORCH = ("2.11.0", "2.13.0", "2.14.1")
PLATFORM = {"platform_system": "Linux", "sys_platform": "linux", "platform_machine": "x86_64",
            "python_version": "3.11", "python_full_version": "3.11.0", "implementation_name": "cpython",
            "platform_python_implementation": "CPython", "os_name": "posix"}


@functools.cache
def _resolve(requirement: str) -> dict:
    """pip's report of what `pip install --no-deps <requirement>` picks for Linux x86_64, CPython
    3.11, binary wheels only: {"version", "requires_dist", "url"}; pytest.skip when the index
    cannot be reached."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "pip", "--isolated", "install", "--dry-run", "--quiet", "--no-deps",
               "--ignore-installed", "--only-binary=:all:", "--platform", "manylinux_2_28_x86_64",
               "--python-version", "3.11", "--target", str(Path(tmp) / "t"), "--report", str(report), requirement]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if run.returncode != 0:
            text = run.stderr + run.stdout
            if any(s in text for s in ("NewConnectionError", "Temporary failure in name resolution", "No route",
                                       "Network is unreachable", "ConnectTimeout", "ReadTimeout")):
                pytest.skip(f"the package index cannot be reached, so {requirement}'s metadata cannot be read")
            raise AssertionError(f"pip could not resolve {requirement}:\n{text[-2000:]}")
        item = json.loads(report.read_text())["install"][0]
    meta = item["metadata"]
    return {"version": meta["version"], "requires_dist": meta.get("requires_dist", []),
            "url": item["download_info"]["url"]}


def triton_of_cuda_torch(torch_version: str) -> str:
    """The Triton release the CUDA torch wheel's own requirement resolves to on Linux x86_64."""
    wheel = _resolve(f"torch=={torch_version}")
    assert "+cpu" not in wheel["url"], f"read a CPU build instead of the CUDA wheel: {wheel['url']}"
    reqs = [Requirement(r) for r in wheel["requires_dist"]]
    tritons = [r for r in reqs if r.name == "triton" and (r.marker is None or r.marker.evaluate(PLATFORM))]
    assert len(tritons) == 1, f"torch {torch_version} on Linux x86_64 requires {len(tritons)} tritons: {tritons}"
    return _resolve(f"triton{tritons[0].specifier}")["version"]


def project_requirements(pyproject: dict, extras=("triton",)) -> list:
    """The base requirements and those of the named extras, as packaging Requirements."""
    project = pyproject["project"]
    reqs = list(project["dependencies"]) + [r for e in extras for r in project["optional-dependencies"][e]]
    return [Requirement(r) for r in reqs]


def install_problems(requirements, torch_version: str, triton_version: str) -> list:
    """Why `pip install "dsv4-tree[triton]"` beside this torch and its Triton cannot resolve
    (empty: it can). Every requirement on torch or triton must admit the installed version."""
    have = {"torch": Version(torch_version), "triton": Version(triton_version)}
    return [f"{r} does not admit {r.name} {have[r.name]} (torch {torch_version}'s CUDA wheel)"
            for r in requirements if r.name in have and (r.marker is None or r.marker.evaluate(PLATFORM))
            and not r.specifier.contains(have[r.name], prereleases=True)]


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


@pytest.fixture(scope="module")
def cuda_tritons() -> dict:
    return {t: triton_of_cuda_torch(t) for t in SUPPORTED_TORCH}


def test_each_cuda_torch_brings_a_known_triton(cuda_tritons):
    # what the wheels require today (a new torch release that moves its pin shows up here first)
    assert cuda_tritons["2.11.0"] == "3.6.0" and cuda_tritons["2.13.0"] == "3.7.1", cuda_tritons
    assert Version(cuda_tritons["2.14.1"]).release[:2] == (3, 8), cuda_tritons


@pytest.mark.parametrize("torch_version", SUPPORTED_TORCH)
def test_the_project_installs_beside_each_cuda_torch(torch_version, cuda_tritons):
    reqs = project_requirements(_pyproject())
    assert install_problems(reqs, torch_version, cuda_tritons[torch_version]) == []


def test_an_exact_triton_pin_is_caught(cuda_tritons):
    """The planted fault this check exists for: the extra pinned back to `triton==3.9.0` (and the
    torch floor back to 2.13) must fail for the torches it shuts out."""
    planted = _pyproject()
    extras = planted["project"]["optional-dependencies"]
    extras["triton"] = ["triton==3.9.0"]
    reqs = project_requirements(planted)
    for t in SUPPORTED_TORCH:
        problems = install_problems(reqs, t, cuda_tritons[t])
        assert len(problems) == 1 and "triton==3.9.0" in problems[0], (t, problems)
    planted["project"]["dependencies"] = ["torch>=2.13,<2.15"]
    problems = install_problems(project_requirements(planted), "2.11.0", cuda_tritons["2.11.0"])
    assert any(p.startswith("torch") and ">=2.13" in p for p in problems), problems


def test_the_cpu_environment_pins_a_triton_the_extra_admits():
    """scripts/env.sh pins each environment's torch and Triton; every pair must satisfy the
    project's requirements too (an environment the project's own pins refuse would test nothing
    a user can install)."""
    text = (ROOT / "scripts" / "env.sh").read_text()
    reqs = project_requirements(_pyproject())
    pairs = []
    for line in text.splitlines():
        if "_torch_pins=(" in line:
            pins = dict(p.split("==") for p in line.split("(", 1)[1].split(")")[0].split() if "==" in p)
            pairs.append((pins["torch"], pins["triton"]))
    assert {t for t, _ in pairs} == set(SUPPORTED_TORCH), pairs
    for torch_version, triton_version in pairs:
        assert install_problems(reqs, torch_version, triton_version) == [], (torch_version, triton_version)
