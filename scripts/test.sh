#!/usr/bin/env bash
# Set everything up from nothing and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
