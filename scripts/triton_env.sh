# Sourced (or run) with a Triton version: make <venv>-triton<version> (.venv-triton3.8.0 over
# .venv), the main environment (scripts/env.sh, with its DSV4_TREE_TORCH) with only Triton
# replaced, for the sm_90a gate under the compiler a GPU user of that version gets
# (design_notes/triton-versions.md):
#     source scripts/triton_env.sh 3.8.0     # sets TRITON_VENV; SGLang 0.5.23's torch 2.14.1 brings 3.8.0
# The Triton wheel goes into a folder cached per version ($DSV4_TREE_CACHE, as the base
# environments); the venv's site-packages reads that folder first, then .venv's. Triton 3.6's
# interpreter (which the gate's recording runs) needs numpy < 2.4, so 3.6 gets that numpy too.
set -euo pipefail
_tv="${1:?usage: triton_env.sh VERSION (3.6.0, 3.7.1, 3.8.0 or 3.9.0)}"
case "$_tv" in
  3.6.0) _tv_pkgs=(triton==3.6.0 "numpy<2.4") ;;
  3.7.1 | 3.8.0 | 3.9.0) _tv_pkgs=("triton==$_tv") ;;
  *) echo "[setup] Triton $_tv: the versions CUDA torches 2.11-2.14 bring are 3.6.0, 3.7.1, 3.8.0 (and 3.9.0)" >&2; return 2 2>/dev/null || exit 2 ;;
esac
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/env.sh"  # .venv, the layer underneath
_tv_cache="${DSV4_TREE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dsv4-tree}"
[ "$_tv_cache" = "off" ] && _tv_cache="$ROOT/.venv-triton$_tv.cache"
_tv_dir="$_tv_cache/triton-$_tv"
if [ ! -f "$_tv_dir/.complete" ]; then
  echo "[setup] installing ${_tv_pkgs[*]} into $_tv_dir" >&2
  rm -rf "$_tv_dir.tmp-$$" && mkdir -p "$_tv_dir.tmp-$$"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps --target "$_tv_dir.tmp-$$" "${_tv_pkgs[@]}"
  touch "$_tv_dir.tmp-$$/.complete"
  rm -rf "$_tv_dir" && mv "$_tv_dir.tmp-$$" "$_tv_dir"
fi
TRITON_VENV="$VENV-triton$_tv"
if [ ! -x "$TRITON_VENV/bin/python" ]; then
  python3 -m venv --without-pip "$TRITON_VENV"
fi
_tv_site="$("$TRITON_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
_tv_main="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
printf "import site; site.addsitedir('%s'); site.addsitedir('%s')\n" "$_tv_dir" "$_tv_main" > "$_tv_site/dsv4_tree_layers.pth"
"$TRITON_VENV/bin/python" -c "import triton, sys; assert triton.__version__ == sys.argv[1], triton.__version__" "$_tv"
export TRITON_VENV
