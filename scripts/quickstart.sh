#!/usr/bin/env bash
# Set everything up from nothing, build a small synthetic MoE model, prep it and
# generate with its experts streamed through an embedded iod daemon.
set -euo pipefail
caller=$PWD
cd "$(dirname "$0")/.."
scripts/setup.sh
ARCH=${ARCH:-qwen3_moe}
PRESET=${PRESET:-tiny}
WORK=${WORK:-out}
mkdir -p "$WORK"
src="$WORK/$ARCH-$PRESET"
dst="$WORK/$ARCH-$PRESET-prep"
if [ ! -d "$src" ]; then
    # quiet unless it fails
    log=$(.venv/bin/infer synth --arch "$ARCH" --preset "$PRESET" --dtype float32 --out "$src" 2>&1) \
        || { echo "$log" >&2; exit 1; }
fi
if [ ! -d "$dst" ]; then
    out=$(.venv/bin/infer prep --model "$src" --out "$dst" --no-progress)
    echo "${out%%$'\n'*}"
fi
echo "The weights of $src are random: the text below is noise, made the way a real model's would be."
echo
.venv/bin/infer run --model "$dst" --prompt "${PROMPT:-Write a short story about a lighthouse.}" --max-tokens "${MAX_TOKENS:-64}"
# The commands are in .venv, not on PATH: say how to reach them, in paths
# that work from where the quickstart was started.
here() { case "$1" in /*) echo "$1" ;; *) [ "$caller" = "$PWD" ] && echo "$1" || echo "$PWD/$1" ;; esac; }
echo
echo "infer is in .venv, not on PATH: activate it, and README.md's commands work ('A real model' for real text):"
printf '    source %q\n' "$(here .venv/bin/activate)"
printf '    infer run --model %q -p "Why is the sky blue?"\n' "$(here "$dst")"
