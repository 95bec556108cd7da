# Sourced by scripts/demo and scripts/test: make .venv with everything installed.
# Installs torch==2.13.0 first (a CPU build; an open range would pull a multi-GB CUDA build),
# then this project's requirements with its hf, test, triton and bench extras, into a base
# environment cached by their hash (scripts/venv_lib.sh); .venv holds this checkout over it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${DSV4_TREE_VENV:-$ROOT/.venv}"
source "$ROOT/scripts/venv_lib.sh"
MAIN_EXTRAS=(hf test triton bench)
extras="$(IFS=,; echo "${MAIN_EXTRAS[*]}")"
_main_requirements="$(printf 'torch==2.13.0\n'; project_requirements "${MAIN_EXTRAS[@]}")"
_build_main() {
  local py="$1"
  echo "[setup] installing torch==2.13.0" >&2
  "$py" -m pip install -q --disable-pip-version-check torch==2.13.0
  echo "[setup] installing the requirements of dsv4-tree[$extras]" >&2
  # shellcheck disable=SC2046
  "$py" -m pip install -q --disable-pip-version-check $(project_requirements "${MAIN_EXTRAS[@]}" | sed 's/ //g')
}
layered_venv "$VENV" venv-main "$_main_requirements" _build_main "$ROOT[$extras]"
export PATH="$VENV/bin:$PATH"
cd "$ROOT"
