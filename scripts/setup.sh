#!/usr/bin/env bash
# Create .venv and install the project (native extension included) into it.
# Quiet; does nothing when the installed build inputs are unchanged (the
# install is editable: Python edits need no reinstall).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
extras="test"
# MLX's CPU backend is a separate package on Linux; macOS wheels carry Metal.
if [ "$(uname -s)" = "Linux" ]; then extras="cpu,test"; fi
stamp=.venv/.iod-moe-installed
want=$(cat pyproject.toml setup.py native/*.c | cksum)" $extras"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] \
    && .venv/bin/python -c "import native._iodnative, importlib.util as u; assert all(map(u.find_spec, ['mlx_lm', 'infer', 'iod']))" 2>/dev/null; then
    exit 0
fi
log=.venv/pip.log
if ! { .venv/bin/python -m pip install -q --upgrade pip \
       && .venv/bin/python -m pip install -q -e ".[${extras}]"; } >"$log" 2>&1; then
    cat "$log" >&2
    echo "setup.sh: pip install failed (log above, also in $log)" >&2
    exit 1
fi
echo "$want" > "$stamp"
