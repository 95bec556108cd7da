import os
import sys

# Triton kernels run on CPU through the interpreter; it must be chosen before triton is
# imported. On a GPU machine run with DSV4_TREE_GPU=1 to compile them for the device: then the
# kernel tests and the device flow tests build their tensors and models on cuda.
GPU_MODE = os.environ.get("DSV4_TREE_GPU") == "1"
if not GPU_MODE:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib.util

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

# tests/with_sglang/ (marker `sglang`) runs in .venv-sglang beside SGLang 0.5.23, where
# scripts/test sends it; an environment without SGLang does not collect it.
collect_ignore = [] if importlib.util.find_spec("sglang") is not None else ["with_sglang"]


def pytest_configure(config):
    # under pytest-xdist (scripts/test runs one worker per core) each worker gets its share of
    # the cores, so torch's intra-op threads do not oversubscribe them
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))
    config.addinivalue_line("markers", "gpu: needs a CUDA device (runs with DSV4_TREE_GPU=1)")
    config.addinivalue_line("markers", "on_device: uses the `device` fixture (added at collection; "
                                       "scripts/gpu_check runs `-m 'gpu or on_device'`)")
    if GPU_MODE and not torch.cuda.is_available():
        raise pytest.UsageError("DSV4_TREE_GPU=1 but torch sees no CUDA device")


def pytest_addoption(parser):
    parser.addoption("--shuffle-files", type=int, default=None, metavar="SEED",
                     help="run the test files in an order shuffled by SEED (each file's tests in their own "
                          "order): with -p no:xdist, a check that no test depends on what ran before it")


def _shuffle_files(items, seed: int) -> None:
    import random

    files = list(dict.fromkeys(item.path for item in items))
    random.Random(seed).shuffle(files)
    rank = {f: i for i, f in enumerate(files)}
    items.sort(key=lambda item: rank[item.path])  # stable: a file's tests keep their order


def pytest_collection_modifyitems(config, items):
    seed = config.getoption("--shuffle-files")
    if seed is not None:
        _shuffle_files(items, seed)
    for item in items:
        if "device" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.on_device)
    # the one place a test is skipped for want of a GPU: the `gpu` marker outside GPU mode
    if GPU_MODE:
        return
    skip = pytest.mark.skip(reason="gpu test: run with DSV4_TREE_GPU=1 on a CUDA machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def device() -> torch.device:
    """Where kernel and device-flow tests put tensors and models: cuda in GPU mode, else the
    CPU (kernels through the Triton interpreter)."""
    return torch.device("cuda" if GPU_MODE else "cpu")


@pytest.fixture(autouse=True, scope="session")
def _tiny_home(tmp_path_factory):
    # keep the generated tiny checkpoint out of the user's home during tests
    if "DSV4_TREE_HOME" not in os.environ:
        os.environ["DSV4_TREE_HOME"] = str(tmp_path_factory.mktemp("dsv4_home"))
    yield
