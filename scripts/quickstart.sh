#!/usr/bin/env bash
# Set everything up from nothing, build a synthetic MoE model, prep it and
# generate with its experts streamed through an embedded iod daemon.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
ARCH=${ARCH:-qwen3_moe}
PRESET=${PRESET:-tiny}
WORK=${WORK:-out}
mkdir -p "$WORK"
[ -d "$WORK/$ARCH-$PRESET" ] || .venv/bin/infer synth --arch "$ARCH" --preset "$PRESET" --dtype float32 --out "$WORK/$ARCH-$PRESET"
[ -d "$WORK/$ARCH-$PRESET-prep" ] || .venv/bin/infer prep --model "$WORK/$ARCH-$PRESET" --out "$WORK/$ARCH-$PRESET-prep"
.venv/bin/infer run --model "$WORK/$ARCH-$PRESET-prep" --prompt "${PROMPT:-Write a short story about a lighthouse.}" --max-tokens "${MAX_TOKENS:-64}"
