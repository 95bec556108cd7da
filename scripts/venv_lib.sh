# Sourced by scripts/env.sh and scripts/sglang_env.sh: an environment in two layers.
#
#   base  what the environment installs from the package index (torch, transformers, SGLang,
#         ...), keyed by a hash of what it installs: $DSV4_TREE_CACHE/<name>-<hash> (default
#         ~/.cache/dsv4-tree). Built in a temporary folder and renamed into place once the build
#         succeeded, so a machine that keeps its cache builds it once per change of
#         requirements, a half-built base is never used, and a clean machine builds it.
#         (Only the base's python and site-packages are used, never its bin/ scripts, whose
#         paths a rename would leave stale.)
#   thin  the checkout's own venv (.venv, .venv-sglang): a fresh venv whose site-packages adds
#         the base's (one .pth line), plus this checkout's editable install. Two checkouts
#         share a base, never each other's code.
#
# DSV4_TREE_CACHE=off keeps the base inside the thin venv's folder (nothing shared).

# project_requirements EXTRAS...: this project's requirements and those of its extras, one per
# line (what a base installs for it; the project itself goes into the thin venv)
project_requirements() {
  python3 - "$ROOT/pyproject.toml" "$@" <<'PY'
import sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
reqs = list(project["dependencies"])
for extra in sys.argv[2:]:
    reqs += project["optional-dependencies"][extra]
print("\n".join(reqs))
PY
}

# layered_venv VENV NAME KEY BUILD PROJECT_SPEC
#   BUILD: a function called with the base's python (installs the index packages);
#   KEY: text naming everything BUILD installs; PROJECT_SPEC: what `pip install --no-deps -e`
#   installs into the thin venv (this checkout, with its extras).
layered_venv() {
  local venv="$1" name="$2" key="$3" build="$4" project="$5"
  local cache="${DSV4_TREE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dsv4-tree}"
  key="$(printf '%s\n%s\n' "$key" "$(python3 -c 'import sys; print(sys.version)')" | sha256sum | cut -c1-16)"
  local base="$cache/$name-$key"
  [ "$cache" = "off" ] && base="$venv.base-$key"
  if [ ! -x "$base/bin/python" ]; then
    echo "[setup] building the $name base environment (once per change of requirements): $base" >&2
    mkdir -p "$(dirname "$base")"
    local tmp="$base.tmp-$$"
    rm -rf "$tmp"
    python3 -m venv "$tmp"
    # pip and setuptools for the thin venv's editable install, which has neither of its own
    "$tmp/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip "setuptools>=68"
    "$build" "$tmp/bin/python"
    if [ -x "$base/bin/python" ]; then rm -rf "$tmp"; else mv "$tmp" "$base"; fi
  fi
  local site
  site="$("$base/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  local stamp="$venv/.dsv4_tree_installed" want
  want="$(printf '%s\n%s\n%s\n' "$base" "$project" "$(sha256sum "$ROOT/pyproject.toml")" | sha256sum | cut -d' ' -f1)"
  if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] || [ ! -x "$venv/bin/python" ]; then
    echo "[setup] $venv: this checkout over $base" >&2
    rm -rf "$venv"
    python3 -m venv --without-pip "$venv"
    local own
    own="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    # addsitedir also runs the base's own .pth files (editable finders, distutils shims)
    echo "import site; site.addsitedir('$site')" > "$own/dsv4_tree_base.pth"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e "$project"
    echo "$want" > "$stamp"
  fi
}
