#!/usr/bin/env bash
# Creates .venv with Python 3.12 and installs jaxrl_fp8 (all three packages) into it.
#   scripts/setup.sh          runtime dependencies
#   scripts/setup.sh --test   plus the test-only reference stack (pytest, torch, transformers)
set -euo pipefail
cd "$(dirname "$0")/.."

find_python() {
  for cand in "${PYTHON:-}" python3.12 "$(command -v pyenv >/dev/null 2>&1 && pyenv root)/versions/3.12"*/bin/python3.12; do
    [ -n "$cand" ] || continue
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
      command -v "$cand"; return 0
    fi
  done
  # pyenv shims resolve python3.12 only when a 3.12 is installed; try every installed 3.12 directly.
  for cand in "$HOME"/.pyenv/versions/3.12*/bin/python3.12 /usr/bin/python3.12 /usr/local/bin/python3.12; do
    [ -x "$cand" ] && { echo "$cand"; return 0; }
  done
  echo "setup.sh: Python 3.12 not found (install it, e.g. 'pyenv install 3.12', or set PYTHON=/path/to/python3.12)" >&2
  return 1
}

PY=$(find_python)
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then
  rm -rf .venv
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
extra=""
[ "${1:-}" = "--test" ] && extra="[test]"
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".${extra}" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import jaxrl_fp8, pallas_kernels, converters" || { echo "setup.sh: install failed" >&2; exit 1; }
echo "setup.sh: .venv ready ($(.venv/bin/python --version))"
