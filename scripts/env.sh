#!/usr/bin/env bash
# Sourced by the other scripts: finds a Python >= 3.12 and makes/updates the project venv in .venv.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${FP4JAX_VENV:-$ROOT/.venv}

find_python() {
  local c
  for c in "${PYTHON:-}" python3.13 python3.12 python3 \
           $(ls -d "$(pyenv root 2>/dev/null || echo ~/.pyenv)"/versions/3.1[2-9]*/bin/python3 2>/dev/null); do
    [ -n "$c" ] || continue
    command -v "$c" >/dev/null 2>&1 || continue
    if PYENV_VERSION= "$c" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      echo "$c"; return 0
    fi
  done
  # pyenv shims: try every installed 3.12+ explicitly.
  for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.(1[2-9])' || true); do
    if PYENV_VERSION=$v python3 -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      echo "$(PYENV_VERSION=$v pyenv which python3)"; return 0
    fi
  done
  return 1
}

if [ ! -x "$VENV/bin/python" ]; then
  PY=$(find_python) || { echo "fp4jax needs Python >= 3.12 (JAX 0.11); none found. Set PYTHON=/path/to/python3.12" >&2; exit 1; }
  echo "[fp4jax] creating $VENV with $PY" >&2
  "$PY" -m venv "$VENV"
fi
stamp="$VENV/.fp4jax-installed"
if [ ! -f "$stamp" ] || [ "$ROOT/pyproject.toml" -nt "$stamp" ]; then
  echo "[fp4jax] installing dependencies into $VENV (pinned jax==0.11.2, CPU)" >&2
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q -e "$ROOT[test]"
  touch "$stamp"
fi
export PATH="$VENV/bin:$PATH"
cd "$ROOT"
