"""The wheel holds every package of the source tree.

pyproject.toml lists its packages by name (kernels/ installs as dsv4_tree.kernels), so a new
package directory missing from the list would import from a checkout or an editable install and
be absent from a wheel a user installs."""
from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _source_packages() -> set:
    names = set()
    for init in (ROOT / "dsv4_tree").rglob("__init__.py"):
        names.add(".".join(init.parent.relative_to(ROOT).parts))
    for init in (ROOT / "kernels").rglob("__init__.py"):
        names.add(".".join(("dsv4_tree", "kernels", *init.parent.relative_to(ROOT / "kernels").parts)))
    return names


def test_every_source_package_is_in_the_wheel():
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    listed = set(conf["packages"])
    found = _source_packages()
    assert found - listed == set(), f"packages missing from pyproject.toml's [tool.setuptools] packages: {sorted(found - listed)}"
    assert listed - found == set(), f"pyproject.toml lists packages with no source directory: {sorted(listed - found)}"
    assert conf["package-dir"] == {"dsv4_tree.kernels": "kernels"}
    # every directory of .py files is a package (no namespace directory left out of the list)
    dirs = {p.parent for top in ("dsv4_tree", "kernels") for p in (ROOT / top).rglob("*.py")}
    assert all((d / "__init__.py").is_file() for d in dirs), sorted(str(d) for d in dirs if not (d / "__init__.py").is_file())
