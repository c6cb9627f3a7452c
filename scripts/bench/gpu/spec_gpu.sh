#!/usr/bin/env bash
# Speculative decoding on the lent GPU (MLX CUDA): the figures of
# docs/speculative.md, in one invocation (~5-6 minutes of device time).
#
# usage: scripts/bench/gpu/spec_gpu.sh PREP OUT
#   PREP  prep folder of the benchmark-scale trained qwen3_next (with its MTP
#         head: mtp.safetensors and the head's expert blob)
#   OUT   folder for the results (created): one JSON per step, spec_gpu.log
#
# Steps, each one `infer bench` (JSON: docs/benchmarks.md, "draft" object:
# docs/speculative.md), every configuration against plain greedy decoding
# in the same process, ids compared:
#   check      batched and row-wise passes against one-token steps, bit for
#              bit (K = 1..3, 64 tokens): is a batched verify exact here?
#   mtp-100    --draft mtp, K = 1,2,3, lockstep and row-wise verify, all
#              experts resident (mlx-lm's own model)
#   mtp-25     the same, experts streamed through iod, 25% expert cache
#   ngram-100  --draft ngram on the repetitive code prompt (@code), K = 2,4,
#              lockstep and row-wise verify, resident
#   auto-100   --draft auto (lockstep and row-wise), @code, resident
# Each step runs under its own time limit; a step that fails or times out is
# logged and the next one runs. Environment (all optional):
#   PYTHON (python3), RUNS (2; the streamed step uses RUNS_STREAMED, 1),
#   TOKENS (128), DTYPE (the folder's), LIMIT (seconds per step, 150),
#   STEPS (space-separated subset of the names above).
# No network is needed; MLX (CUDA), mlx-lm, numpy, pyzmq and msgpack must be
# importable (PYTHONPATH); the native extension is built here if missing.
set -uo pipefail

if [ $# -ne 2 ]; then
    echo "usage: $0 PREP OUT" >&2
    exit 2
fi
PREP=$(cd "$1" && pwd) || { echo "$0: no folder $1" >&2; exit 2; }
OUT=$2
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
PY=${PYTHON:-python3}
RUNS=${RUNS:-2}
RUNS_STREAMED=${RUNS_STREAMED:-1}
TOKENS=${TOKENS:-128}
LIMIT=${LIMIT:-150}
STEPS=${STEPS:-"check mtp-100 mtp-25 ngram-100 auto-100"}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
LOG="$OUT/spec_gpu.log"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
cd "$ROOT"

log() { echo "[$(date +%T)] $*" | tee -a "$LOG" >&2; }

if ! "$PY" -c "import native._iodnative" 2>/dev/null; then
    log "building the native extension"
    "$PY" setup.py -q build_ext --inplace >>"$LOG" 2>&1 || { log "native build failed"; exit 1; }
fi
if ! "$PY" - >>"$LOG" 2>&1 <<'EOF'
import mlx.core as mx, mlx_lm, platform
print("mlx", mx.__version__, "mlx-lm", mlx_lm.__version__, "device", mx.default_device(),
      "python", platform.python_version())
EOF
then
    log "$PY cannot import mlx / mlx-lm (see $LOG)"
    exit 1
fi
tail -1 "$LOG" >&2
[ -f "$PREP/mtp.safetensors" ] || log "warning: $PREP has no mtp.safetensors (the mtp steps will be refused)"

dtype=()
[ -n "${DTYPE:-}" ] && dtype=(--dtype "$DTYPE")
common=(--model "$PREP" --raw-prompt --max-tokens 8 --draft-tokens "$TOKENS" "${dtype[@]}")

step() {  # name, then the bench arguments
    local name=$1; shift
    case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
    local t0=$SECONDS
    log "$name: infer bench $*"
    timeout --signal=TERM --kill-after=10 "$LIMIT" \
        "$PY" -m infer.cli bench "${common[@]}" "$@" --json "$OUT/$name.json" \
        >"$OUT/$name.txt" 2>>"$LOG"
    local rc=$?
    cat "$OUT/$name.txt" >>"$LOG"
    log "$name: exit $rc after $((SECONDS - t0)) s"
}

step check --modes resident --runs 1 --draft mtp --num-draft 1,2,3 --verify rowwise \
    --draft-tokens 64 --draft-check --prompt @prose
step mtp-100 --modes resident --runs "$RUNS" --draft mtp --num-draft 1,2,3 --verify exact,rowwise \
    --prompt @prose
step mtp-25 --modes iod --budget 0.25 --runs "$RUNS_STREAMED" --draft mtp --num-draft 1,2,3 \
    --verify exact,rowwise --prompt @prose
step ngram-100 --modes resident --runs "$RUNS" --draft ngram --num-draft 2,4 --verify exact,rowwise \
    --prompt @code
step auto-100 --modes resident --runs "$RUNS" --draft auto --num-draft 3 --verify exact,rowwise \
    --prompt @code

"$PY" - "$OUT" <<'EOF' | tee -a "$LOG"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for f in sorted(out.glob("*.json")):
    r = json.loads(f.read_text())
    for mode, m in r.get("modes", {}).items():
        d = m.get("draft")
        if not d:
            print(f"{f.stem:10s} {mode}: {m.get('error', m.get('skipped', 'no draft figures'))[:200]}")
            continue
        for c in d["configs"]:
            if "error" in c:
                print(f"{f.stem:10s} {mode:8s} {c['kind']:5s} {c['verify']:7s} K={c['k']} failed: {c['error'][:300]}")
                continue
            print(f"{f.stem:10s} {mode:8s} {c['kind']:5s} {c['verify']:7s} K={c['k']} "
                  f"tok/pass {c['accept_len']:.2f} accept {c['acceptance_rate']:.2f} "
                  f"{c['decode_tok_s']:.1f} vs {c['baseline_decode_tok_s']:.1f} tok/s "
                  f"x{c['speedup']:.2f} [{min(c['speedup_runs']):.2f}-{max(c['speedup_runs']):.2f}] "
                  f"MB/tok {c['bytes_read_per_token'] / 1e6:.2f} (plain {c['baseline_bytes_read_per_token'] / 1e6:.2f}) "
                  f"exact {c['exact']}")
        for k, v in d.get("check", {}).items():
            print(f"{f.stem:10s} check K={k}: {v}")
EOF
log "done; results in $OUT"
