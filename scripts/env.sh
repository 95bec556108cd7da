# Sourced by scripts/demo and scripts/test: make .venv with everything installed.
# Installs torch first, then this project's requirements with its hf, test, triton and bench
# extras, into a base environment cached by their hash (scripts/venv_lib.sh); .venv holds this
# checkout over it.
#
# DSV4_TREE_TORCH picks the torch (default 2.13.0, a CPU build found locally; an open range would
# pull a multi-GB CUDA build). Each torch comes with the Triton its CUDA wheel requires
# (design_notes/triton-versions.md): 2.13.0's CPU build requires none, so 3.9.0 is pinned here;
# 2.11.0 (the CUDA image's torch) brings 3.6.0, whose interpreter needs numpy < 2.4; 2.14.1
# brings 3.8.0. A torch other than 2.13.0 gets its own venv, .venv-torch<version>.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DSV4_TREE_TORCH="${DSV4_TREE_TORCH:-2.13.0}"
case "$DSV4_TREE_TORCH" in
  2.13.0) _torch_pins=(torch==2.13.0 triton==3.9.0); _default_venv="$ROOT/.venv" ;;
  2.11.0) _torch_pins=(torch==2.11.0 triton==3.6.0 "numpy<2.4"); _default_venv="$ROOT/.venv-torch2.11.0" ;;
  2.14.1) _torch_pins=(torch==2.14.1 triton==3.8.0); _default_venv="$ROOT/.venv-torch2.14.1" ;;
  *) echo "[setup] DSV4_TREE_TORCH=$DSV4_TREE_TORCH: known torches are 2.11.0, 2.13.0 and 2.14.1" >&2; return 2 ;;
esac
VENV="${DSV4_TREE_VENV:-$_default_venv}"
source "$ROOT/scripts/venv_lib.sh"
MAIN_EXTRAS=(hf test triton bench)
extras="$(IFS=,; echo "${MAIN_EXTRAS[*]}")"
_main_requirements="$(printf '%s\n' "${_torch_pins[@]}"; project_requirements "${MAIN_EXTRAS[@]}")"
_build_main() {
  local py="$1" pins
  pins="$(dirname "$(dirname "$py")")/torch-pins.txt"
  printf '%s\n' "${_torch_pins[@]}" > "$pins"
  echo "[setup] installing ${_torch_pins[*]}" >&2
  "$py" -m pip install -q --disable-pip-version-check "${_torch_pins[@]}"
  echo "[setup] installing the requirements of dsv4-tree[$extras]" >&2
  # shellcheck disable=SC2046
  "$py" -m pip install -q --disable-pip-version-check -c "$pins" $(project_requirements "${MAIN_EXTRAS[@]}" | sed 's/ //g')
}
layered_venv "$VENV" "venv-main-torch$DSV4_TREE_TORCH" "$_main_requirements" _build_main "$ROOT[$extras]"
export PATH="$VENV/bin:$PATH"
cd "$ROOT"
