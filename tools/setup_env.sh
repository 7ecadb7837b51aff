#!/usr/bin/env bash
# Creates .venv with Python >= 3.12 (jax 0.11.2 needs it) and installs deltajax with its test extras.
# Idempotent: re-running only checks that the environment is complete.
set -euo pipefail
cd "$(dirname "$0")/.."

is_recent() { "$@" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1; }

find_python() {
  # Prefer 3.12 (the GPU machine's version), then any newer Python.
  if [ -n "${PYTHON:-}" ] && is_recent "$PYTHON"; then echo "$PYTHON"; return 0; fi
  if is_recent python3.12; then echo python3.12; return 0; fi
  # pyenv installs a 3.12 that is only reachable with PYENV_VERSION set.
  if command -v pyenv >/dev/null 2>&1; then
    local version
    version=$(pyenv versions --bare 2>/dev/null | grep -E '^3\.12(\.|$)' | sort -V | tail -n 1 || true)
    if [ -n "$version" ] && is_recent env PYENV_VERSION="$version" python3.12; then
      echo "env PYENV_VERSION=$version python3.12"; return 0
    fi
  fi
  local candidate
  for candidate in python3.13 python3.14 python3; do
    if is_recent "$candidate"; then echo "$candidate"; return 0; fi
  done
  return 1
}

if [ ! -x .venv/bin/python ]; then
  python_cmd=$(find_python) || { echo "deltajax needs Python >= 3.12 (set PYTHON=/path/to/python3.12)" >&2; exit 1; }
  echo "creating .venv with: $python_cmd"
  $python_cmd -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -e ".[test]"
.venv/bin/python -c 'import jax, deltajax; print("deltajax ready: jax", jax.__version__, jax.default_backend())'
