# Sourced by scripts/test for the `sglang` tests: make .venv-sglang, an environment as a user of
# SGLang 0.5.23 has it (sglang==0.5.23 with its pins torch==2.14.1 and transformers==5.19.0),
# minus SGLang's GPU-only packages (flashinfer, sglang-kernel, FlashMLA, DeepGEMM, ...), which
# the CPU tests never reach. Then dsv4-tree itself, without its Hugging Face extra.
# PyPI has no CPU build of torch 2.14.1: the CUDA build (and its nvidia-* libraries) is
# installed and runs on the CPU. The packages go into a base environment cached by their hash
# (scripts/venv_lib.sh); .venv-sglang holds this checkout over it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SGLANG_VENV="${DSV4_TREE_SGLANG_VENV:-$ROOT/.venv-sglang}"
source "$ROOT/scripts/venv_lib.sh"
# sglang 0.5.23's own pins for the packages both projects use
SGLANG_PINS=(torch==2.14.1 transformers==5.19.0 tokenizers==0.23.2 sglang==0.5.23)
# what `import sglang.srt...` needs on a CPU (the modules the tests load), at sglang's pins
SGLANG_CPU_DEPS=(transformers==5.19.0 "apache-tvm-ffi==0.1.11" "sentencepiece==0.2.1"
  "compressed-tensors==0.18.0" "openai==2.8.0" numpy msgspec orjson psutil pybase64 requests
  packaging pillow pydantic pyzmq tqdm IPython aiohttp dill gguf einops partial-json-parser
  uvicorn fastapi zstandard setproctitle "tokenizers==0.23.2" torchvision)
_sglang_requirements="$(printf '%s\n' "${SGLANG_PINS[@]}" "${SGLANG_CPU_DEPS[@]}"; project_requirements test)"
_build_sglang() {
  local py="$1" pins
  pins="$(dirname "$(dirname "$py")")/sglang-pins.txt"
  printf '%s\n' "${SGLANG_PINS[@]}" > "$pins"
  pipi() { "$py" -m pip install -q --disable-pip-version-check -c "$pins" "$@"; }
  echo "[setup] installing torch==2.14.1 and sglang==0.5.23 (no GPU-only packages)" >&2
  pipi torch==2.14.1
  pipi --no-deps sglang==0.5.23
  pipi "${SGLANG_CPU_DEPS[@]}"
  echo "[setup] installing the requirements of dsv4-tree[test]" >&2
  # shellcheck disable=SC2046
  pipi $(project_requirements test | sed 's/ //g')
}
layered_venv "$SGLANG_VENV" venv-sglang "$_sglang_requirements" _build_sglang "$ROOT[test]"
