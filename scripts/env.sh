# Sourced by scripts/demo and scripts/test: make .venv with everything installed.
# Installs torch==2.13.0 first (a CPU build; an open range would pull a multi-GB CUDA build),
# then this package with its test extras. Re-installs only when pyproject.toml changes.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${DSV4_TREE_VENV:-$ROOT/.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV" >&2
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
stamp="$VENV/.dsv4_tree_installed"
want="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  if ! "$PY" -c "import torch" 2>/dev/null; then
    echo "[setup] installing torch==2.13.0" >&2
    "$PY" -m pip install -q --disable-pip-version-check torch==2.13.0
  fi
  echo "[setup] installing dsv4-tree and test requirements" >&2
  "$PY" -m pip install -q --disable-pip-version-check -e "$ROOT[hf,test,triton,bench]"
  echo "$want" > "$stamp"
fi
export PATH="$VENV/bin:$PATH"
cd "$ROOT"
