"""`pip install "dsv4-tree[sglang]"` beside SGLang 0.5.23 changes none of SGLang's pins: every
requirement of dsv4-tree with its `sglang` extra holds for the packages SGLang 0.5.23 pins
(installed here by scripts/sglang_env.sh), and the exact transformers pin is the `hf` extra's."""
import importlib.metadata as md

from packaging.requirements import Requirement

SGLANG_PINS = {"sglang": "0.5.23", "torch": "2.14.1", "transformers": "5.19.0"}


def requirements(extra: str | None) -> list[Requirement]:
    out = []
    for text in md.requires("dsv4-tree") or []:
        req = Requirement(text)
        env = {"extra": extra or ""}
        if req.marker is None and extra is None or req.marker is not None and req.marker.evaluate(env) and extra:
            out.append(req)
    return out


def test_environment_has_sglangs_pins():
    for name, version in SGLANG_PINS.items():
        assert md.version(name).split("+")[0] == version, name


def test_our_requirements_hold_for_sglangs_pins():
    reqs = requirements(None) + requirements("sglang")
    assert any(r.name == "sglang" for r in reqs)
    for r in reqs:
        installed = md.version(r.name).split("+")[0]
        assert r.specifier.contains(installed, prereleases=True), (str(r), installed)
    names = {r.name for r in reqs}
    assert "transformers" not in names  # left to SGLang's pin


def test_transformers_pin_is_the_hf_extra():
    hf = {r.name: str(r.specifier) for r in requirements("hf")}
    assert hf.get("transformers") == "==5.23.0"


def test_triton_is_the_one_the_main_suites_gate_compiles_with():
    """SGLang's torch 2.14.1 brings Triton 3.8.x, under which the plug-in's kernels run on a GPU.
    The main suite compiles the sm_90a gate under exactly this version (tests/test_aot_gate.py,
    scripts/triton_env.sh): a move here must move that version too."""
    import re

    from pathlib import Path

    gate = (Path(__file__).resolve().parents[1] / "test_aot_gate.py").read_text()
    assert f'SGLANG_TRITON = "{md.version("triton")}"' in gate, re.findall(r"SGLANG_TRITON = .*", gate)
