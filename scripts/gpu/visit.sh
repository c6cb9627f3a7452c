#!/usr/bin/env bash
# One step of a visit to the lent H200 (see docs/benchmarks.md, "GPU"):
#   scripts/gpu/visit.sh setup|q30|bench14 [budgets...]|trained
# Results go to $OUT (the device tool's folder that comes back).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=/tmp/site:$PWD MLX_PTX_CACHE_DIR=${MLX_PTX_CACHE_DIR:-/root/ptx} PYTHONUNBUFFERED=1
export IOD_DISK_PROFILE=${IOD_DISK_PROFILE:-/root/disk.json}
W=${W:-/root/w}
RUN=${RUN:-/root/iodrun}
export IOD_RUN_DIR=$RUN
mkdir -p "$W" "$OUT" "$RUN" && chmod 700 "$RUN"
infer() { python3 -m infer.cli "$@"; }
iod() { python3 -m iod.cli "$@"; }
log() { echo "== $(date +%T) $*"; }

case "$1" in
setup)
  bash scripts/gpu/setup.sh 2>&1 | tee "$OUT/setup.txt" ;;
q30)  # the qwen3-30b-a3b preset (random weights, 4-bit, bf16), its disk, warm kernels
  log synth; time infer synth --arch qwen3_moe --preset "${PRESET:-qwen3-30b-a3b}" --dtype "${DTYPE:-bfloat16}" --out "$W/q30-src" --force | tail -2
  log prep; time infer prep --model "$W/q30-src" --out "$W/q30" --force | tail -2
  rm -rf "$W/q30-src"
  log doctor; iod doctor --model "$W/q30" --seconds 1 --rounds 2 --plot "$OUT/doctor.png" --json > "$OUT/doctor.json"
  log dd; for f in "$W"/q30/layer010.blob "$W"/q30/layer030.blob; do dd if="$f" of=/dev/null bs=3M iflag=direct 2>&1 | tail -1; done | tee "$OUT/dd.txt"
  log warm; time infer run --model "$W/q30" --max-tokens 4 --prompt "Hello" 2>&1 | tail -3
  ;;
bench14)  # issue 14: budget 1.0 warm (resident, iod), then sync and iod cold at each budget
  shift
  budgets=${*:-1.0 0.25 0.1 0.5}
  for b in $budgets; do
    if [ "$b" = 1.0 ]; then flags="--warm --modes ${MODES1:-resident,iod}"; else flags="--modes ${MODES:-sync,iod}"; fi
    log "bench $b $flags"
    timeout ${BENCH_S:-170} python3 -m infer.bench --model "$W/q30" --budget "$b" --runs 1 --max-tokens 24 \
      $flags --json "$OUT/bench14-$b.json" 2>&1 | tail -8
  done ;;
trained)  # issue 13/15: a benchmark-scale qwen3_moe trained here, its routing and a bench
  M=${MINUTES:-5.5}
  log train; infer train --arch qwen3_moe --preset small --corpus "${CORPUS:-stdlib}" --minutes "$M" --seed 0 \
    --dtype bfloat16 --no-judge --out "$W/ts" --force 2>&1 | tail -12
  cp "$W/ts/train.json" "$OUT/train-small.json"
  log prep; infer prep --model "$W/ts" --out "$W/tsp" --force 2>&1 | tail -1
  log routing; infer routing --model "$W/tsp" --text "$W/ts/heldout.txt" --tokens 1024 --json "$OUT/routing-small.json" 2>&1 | tail -12
  for b in ${BUDGETS:-0.25 0.1}; do
    log "bench $b"; timeout 100 python3 -m infer.bench --model "$W/tsp" --budget "$b" --runs 1 --max-tokens 32 \
      --modes resident,sync,iod --json "$OUT/bench-small-$b.json" 2>&1 | tail -5
  done ;;
esac
