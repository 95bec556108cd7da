import os
import sys

# Triton kernels run on CPU through the interpreter; it must be chosen before triton is
# imported. On a GPU machine run with DSV4_TREE_GPU=1 to compile them for the device.
if os.environ.get("DSV4_TREE_GPU") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

sys.path.insert(0, os.path.dirname(__file__))

def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device")


@pytest.fixture(autouse=True, scope="session")
def _tiny_home(tmp_path_factory):
    # keep the generated tiny checkpoint out of the user's home during tests
    if "DSV4_TREE_HOME" not in os.environ:
        os.environ["DSV4_TREE_HOME"] = str(tmp_path_factory.mktemp("dsv4_home"))
    yield
