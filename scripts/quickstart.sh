#!/usr/bin/env bash
# Set everything up from nothing, build a small synthetic MoE model, prep it and
# generate with its experts streamed through an embedded iod daemon.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
ARCH=${ARCH:-qwen3_moe}
PRESET=${PRESET:-tiny}
WORK=${WORK:-out}
mkdir -p "$WORK"
src="$WORK/$ARCH-$PRESET"
dst="$WORK/$ARCH-$PRESET-prep"
if [ ! -d "$src" ]; then
    .venv/bin/infer synth --arch "$ARCH" --preset "$PRESET" --dtype float32 --out "$src" 2>/dev/null
fi
if [ ! -d "$dst" ]; then
    out=$(.venv/bin/infer prep --model "$src" --out "$dst" --no-progress)
    echo "${out%%$'\n'*}"
fi
echo
echo "The weights of $src are random: the text below is noise, made the way a real"
echo "model's would be. For real text, prep a real model (README.md: 'A real model')."
echo
.venv/bin/infer run --model "$dst" --prompt "${PROMPT:-Write a short story about a lighthouse.}" --max-tokens "${MAX_TOKENS:-64}"
