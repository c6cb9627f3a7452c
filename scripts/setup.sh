#!/usr/bin/env bash
# Create .venv and install the project (native extension included) into it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
extras="test"
# MLX's CPU backend is a separate package on Linux; macOS wheels carry Metal.
if [ "$(uname -s)" = "Linux" ]; then extras="cpu,test"; fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -e ".[${extras}]"
