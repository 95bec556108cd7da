"""The `sglang` tests: SGLang 0.5.23's own functions on the CPU, in .venv-sglang
(scripts/sglang_env.sh). Every test here is marked `sglang`; scripts/test routes them.

CPU settings (before any SGLang import): Triton kernels through the interpreter (the parent
conftest sets TRITON_INTERPRET=1), the indexer's torch reference instead of DeepGEMM
(SGLANG_FP8_PAGED_MQA_LOGITS_TORCH=1). FlashMLA's schedule object (a CUDA-only `flash_mla`
import inside `_create_flashmla_metadata`) is replaced by `None` in the tests that build
metadata: it is an opaque handle FlashMLA fills on its first call, no metadata field is derived
from it."""
import os

os.environ.setdefault("SGLANG_FP8_PAGED_MQA_LOGITS_TORCH", "1")

import pytest


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.sglang)


@pytest.fixture
def no_flashmla_schedule(monkeypatch):
    from sglang.srt.layers.attention import deepseek_v4_backend as dsv4

    monkeypatch.setattr(dsv4, "_create_flashmla_metadata", lambda: None)
