# Sourced by scripts/test for the `sglang` tests: make .venv-sglang, an environment as a user of
# SGLang 0.5.23 has it (sglang==0.5.23 with its pins torch==2.14.1 and transformers==5.19.0),
# minus SGLang's GPU-only packages (flashinfer, sglang-kernel, FlashMLA, DeepGEMM, ...), which
# the CPU tests never reach. Then dsv4-tree itself, without its Hugging Face extra.
# PyPI has no CPU build of torch 2.14.1: the CUDA build (and its nvidia-* libraries) is
# installed and runs on the CPU. Re-installs only when pyproject.toml or this file changes.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SGLANG_VENV="${DSV4_TREE_SGLANG_VENV:-$ROOT/.venv-sglang}"
if [ ! -x "$SGLANG_VENV/bin/python" ]; then
  echo "[setup] creating $SGLANG_VENV" >&2
  python3 -m venv "$SGLANG_VENV"
fi
SPY="$SGLANG_VENV/bin/python"
stamp="$SGLANG_VENV/.dsv4_tree_installed"
want="$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/sglang_env.sh" | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  pins="$SGLANG_VENV/sglang-pins.txt"
  # sglang 0.5.23's own pins for the packages both projects use
  printf 'torch==2.14.1\ntransformers==5.19.0\ntokenizers==0.23.2\nsglang==0.5.23\n' > "$pins"
  pipi() { "$SPY" -m pip install -q --disable-pip-version-check -c "$pins" "$@"; }
  echo "[setup] installing torch==2.14.1 and sglang==0.5.23 (no GPU-only packages)" >&2
  pipi torch==2.14.1
  pipi --no-deps sglang==0.5.23
  echo "[setup] (pip's 'sglang 0.5.23 requires ...' lines below name the GPU-only packages left out)" >&2
  # what `import sglang.srt...` needs on a CPU (the modules the tests load), at sglang's pins
  pipi transformers==5.19.0 "apache-tvm-ffi==0.1.11" "sentencepiece==0.2.1" \
    "compressed-tensors==0.18.0" "openai==2.8.0" numpy msgspec orjson psutil pybase64 requests \
    packaging pillow pydantic pyzmq tqdm IPython aiohttp dill gguf einops partial-json-parser \
    uvicorn fastapi zstandard setproctitle "tokenizers==0.23.2" torchvision
  echo "[setup] installing dsv4-tree[test] into $SGLANG_VENV" >&2
  pipi -e "$ROOT[test]"
  echo "$want" > "$stamp"
fi
