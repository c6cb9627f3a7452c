#!/usr/bin/env bash
# One step of a benchmark run on an NVIDIA GPU machine (see docs/benchmarks.md, "GPU"):
#   scripts/bench/gpu/steps.sh setup|unpack|synth|warm|pair|q30|q30trace [budgets...]|dwait [budgets...]|prefill|profile|stackprobe|hang|bench14 [budgets...]|train|prep|trained|budgets|spec|ab|abq30 prefill|decode|abrun|gate|depth|hitsab|ship|tinyspec|overhead|split
# Results go to /root/res/STEP and come back packed as $OUT/STEP.tgz, repacked
# before each sub-step (the device tool returns only a few files a call, and
# nothing a call killed at its time limit had not packed yet).
set -uo pipefail
cd "$(dirname "$0")/../../.."
export PYTHONPATH=/tmp/site:$PWD MLX_PTX_CACHE_DIR=${MLX_PTX_CACHE_DIR:-/root/ptx} PYTHONUNBUFFERED=1
export IOD_DISK_PROFILE=${IOD_DISK_PROFILE:-/root/disk.json}
W=${W:-/root/w}
RUN=${RUN:-/root/iodrun}
export IOD_RUN_DIR=$RUN
PACKED=$OUT/$1.tgz
OUT=/root/res/$1
mkdir -p "$W" "$OUT" "$RUN" "$(dirname "$PACKED")" && chmod 700 "$RUN"
pack() { tar czf "$PACKED" --exclude=trace.json -C /root/res "$(basename "$OUT")" 2>/dev/null; }
trap pack EXIT
infer() { python3 -m infer.cli "$@"; }
iod() { python3 -m iod.cli "$@"; }
log() { pack; echo "== $(date +%T) $*"; }
# ``watched S LOG CMD...``: CMD (output to LOG); still running after S seconds, every
# Python process of it (a bench runs each mode in a child) has its threads' Python and
# native stacks appended to LOG (py-spy, from .gpu/w2), and it is killed: rc 124
watched() {
  local s=$1 out=$2 pid p; shift 2
  "$@" > "$out" 2>&1 & pid=$!
  for _ in $(seq "$s"); do sleep 1; kill -0 $pid 2>/dev/null || { wait $pid; return; }; done
  for p in $pid $(pgrep -P $pid) $(pgrep -P "$(pgrep -P $pid | tr '\n' ',' | sed 's/,$//')" 2>/dev/null); do
    echo "== py-spy $p: $(tr '\0' ' ' < /proc/$p/cmdline 2>/dev/null | cut -c1-120)" >> "$out"
    /tmp/site/bin/py-spy dump --native --pid $p >> "$out" 2>&1
  done
  pkill -9 -P $pid; kill -9 $pid; return 124
}

# The A/B steps: ``alternate F`` runs ``F round side dir`` for ROUNDS rounds, side base (AB_BASE, a
# copy of older infer/ iod/ shared/ native/, in dir) and new (this tree). The order alternates by
# round: benches of one call drift (an H200, 2026-12-06: each slower than the one before), which a
# fixed order charges to the side that runs second
alternate() {
  local base r side dir
  base=$(cd "${AB_BASE:-.gpu/base}" && pwd)
  # the native module this checkout imports (a carried base has none; the glob missed it once)
  cp "$(python3 -c 'import native._iodnative as m; print(m.__file__)')" "$base/native/" || exit 1
  for r in $(seq ${ROUNDS:-2}); do
    for side in $([ $((r % 2)) = 0 ] && echo new base || echo base new); do
      dir=$PWD; [ $side = base ] && dir=$base
      log "round $r $side"
      "$1" "$r" "$side" "$dir"
    done
  done
}

case "$1" in
setup)
  bash scripts/bench/gpu/setup.sh 2>&1 | tee "$OUT/setup.txt"
  # kernels compiled on an earlier run (ptx.tgz from `split`), carried as .gpu/ptx
  if [ -f .gpu/ptx/ptx.tgz ]; then mkdir -p "$MLX_PTX_CACHE_DIR" && tar xzf .gpu/ptx/ptx.tgz -C "$MLX_PTX_CACHE_DIR"; fi ;;
unpack)  # a prep folder shipped from here as .gpu/m/partNN (tar | gzip -1 | split -b 50000000), one part
  # a call copied to /root/stash/m, checked against .gpu/msums.txt (carried with this call)
  (cd /root/stash/m && sha256sum -c --quiet "$OLDPWD/.gpu/msums.txt") || exit 1
  cat /root/stash/m/part* | gunzip | tar -x -C "$W" && ls "$W" ;;
warm)  # the disk's curve, then MLX's kernels compiled by the benchmark's own prompt (an `infer run`
  # of another prompt leaves its prefill's kernels to the first bench)
  log doctor; iod doctor --model "$W/p-${ARCH:-qwen3_next}" --seconds 1 --rounds 2 --json > "$OUT/doctor.json"
  log warm; timeout ${BENCH_S:-420} python3 -m infer.tools.bench --model "$W/p-${ARCH:-qwen3_next}" --budget 1.0 --warm \
    --modes resident,iod --runs 1 --max-tokens 48 --prompt @pycode --raw-prompt --json "$OUT/warm.json" 2>&1 | tail -4 ;;
synth)  # a random-weight model of the trained benchmark's shape (small preset), prepared with a
  # calibration as `prep` prepares the trained one: $W/p-synth, for what routing does not change
  # (whole layers at 1.0) without shipping a model; then ARCH=synth for warm and pair
  log synth; time infer synth --arch "${SYNTH_ARCH:-qwen3_next}" --preset small --dtype bfloat16 --out "$W/s-src" --force | tail -1
  lib=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['stdlib'])")
  cat "$lib"/json/encoder.py "$lib"/textwrap.py "$lib"/shlex.py "$lib"/fractions.py > "$W/calibrate.txt"
  cal="--calibrate $W/calibrate.txt"; [ "${CALIBRATE:-1}" = 0 ] && cal=  # CALIBRATE=0: no usage.json
  log prep; time infer prep --model "$W/s-src" --out "$W/p-synth" $cal --force 2>&1 | tail -1
  rm -rf "$W/s-src" ;;
pair)  # iod against resident interleaved in one process (scripts/bench/bench_pair.py), as stored (bfloat16),
  # at each of BUDGETS; graphs off at a partial budget, as `infer bench` runs a streamed session
  for b in ${BUDGETS:-1.0 0.25}; do
    g=0; [ "$b" = 1.0 ] && g=1
    log "pair $b graphs $g"
    MLX_USE_CUDA_GRAPHS=$g timeout ${BENCH_S:-200} python3 scripts/bench/bench_pair.py "$W/p-${ARCH:-qwen3_next}" \
      --budget "$b" --dtype bfloat16 --tokens ${TOKENS:-96} --block ${BLOCK:-8} --json "$OUT/pair-$b.json" 2>&1 | tail -1
  done ;;
q30)  # the qwen3-30b-a3b preset (random weights, 4-bit, bf16), its disk, warm kernels
  # (LAYERS=12: the preset's layers, fewer of them, the same kernels; DOCTOR=0: no disk curve)
  log synth; time infer synth --arch qwen3_moe --preset "${PRESET:-qwen3-30b-a3b}" ${LAYERS:+--layers "$LAYERS"} \
    --dtype "${DTYPE:-bfloat16}" --out "$W/q30-src" --force | tail -2
  log prep; time infer prep --model "$W/q30-src" --out "$W/q30" --force | tail -2
  rm -rf "$W/q30-src"
  if [ "${DOCTOR:-1}" = 1 ]; then
    log doctor; iod doctor --model "$W/q30" --seconds 1 --rounds 2 --plot "$OUT/doctor.png" --json > "$OUT/doctor.json"
    log dd; for f in "$W"/q30/layer010.blob "$W"/q30/layer030.blob; do dd if="$f" of=/dev/null bs=3M iflag=direct 2>&1 | tail -1; done | tee "$OUT/dd.txt"
  fi
  # a hang (the device wait at 4e0f1e3) dumps every thread's stack at the limit (warm.txt),
  # and the kernels are then warmed with the device wait off, so later steps still run
  log warm; time timeout -s ABRT ${WARM_S:-240} python3 -X faulthandler -m infer.cli run --model "$W/q30" \
    --max-tokens 4 --prompt "Hello" > "$OUT/warm.txt" 2>&1; rc=$?; tail -3 "$OUT/warm.txt"
  if [ $rc != 0 ]; then
    echo "warm-up failed (rc $rc): stacks in warm.txt"; grep -m 30 -E 'File|Thread' "$OUT/warm.txt"
    log "warm device-wait off"; timeout ${WARM_S:-240} python3 -m infer.cli run --model "$W/q30" --max-tokens 4 \
      --prompt "Hello" --device-wait off 2>&1 | tail -3
  fi
  # the kernels it compiled, for `setup` to unpack from .gpu/ptx on a later machine
  tar czf "$(dirname "$PACKED")/ptx.tgz" -C "$MLX_PTX_CACHE_DIR" . ;;
q30trace)  # the q30 preset routed as Qwen3-30B-A3B's recorded trace (TRACE, carried in .gpu/traces):
  # resident, sync and iod at each budget, one run of 24 tokens each (after `q30`)
  shift
  for b in ${*:-0.5 0.25 0.1}; do
    log "bench $b trace"
    timeout ${BENCH_S:-170} python3 -m infer.tools.bench --model "$W/q30" --budget "$b" --runs 1 --max-tokens 24 \
      --modes ${MODES:-resident,sync,iod} --routing-trace "${TRACE:-.gpu/traces/qwen.route.csv}" \
      --json "$OUT/q30trace-$b.json" 2>&1 | tail -8
  done ;;
dwait)  # issue 48's device wait: its tests on this GPU, then `q30` (after the `q30` step) at each
  # budget, device wait on and off alternated, twice, one run of 24 tokens each; routed as the
  # recorded trace where TRACE (default .gpu/traces/qwen.route.csv) is there. Lines go out as they come
  # (TESTS=0: the benches alone; MODES: add resident for the step it is held against;
  # MODEL: another prep folder, e.g. $W/p-synth after `synth`, with TRACE=none)
  shift
  [ "${TESTS:-1}" = 0 ] || { log tests; timeout ${TEST_S:-420} python3 -m pytest -q -p no:cacheprovider \
    tests/test_device_wait.py tests/test_prefill.py 2>&1 | tail -6 | tee "$OUT/tests.txt"; }
  tr=; [ -f "${TRACE:-.gpu/traces/qwen.route.csv}" ] && tr="--routing-trace ${TRACE:-.gpu/traces/qwen.route.csv}"
  for b in ${*:-0.5 0.25 0.1}; do
    for dw in ${DW:-on off on off}; do
      log "bench $b device-wait $dw"
      # (a hang leaves every process's threads' stacks in the log)
      log=$OUT/dwait-$b-$dw-$(date +%s)
      watched ${BENCH_S:-120} "$log.txt" python3 -m infer.tools.bench --model "${MODEL:-$W/q30}" --budget "$b" \
        --runs 1 --max-tokens 24 --modes ${MODES:-iod} --device-wait $dw $tr --json "$log.json" || echo "rc $?"
      grep -E "^(iod|resident|sync|runs|decode speed|infer bench: )" "$log.txt"
    done
  done ;;
prefill)  # issue 48's prefill target (after `q30`): a long prompt (the corpus's first PROMPT_CHARS
  # characters) at BUDGET, resident and iod, layer-major and chunked alternated; prompt_tokens,
  # prefill_tok_s and prefill_bytes in each JSON
  text=$(head -c ${PROMPT_CHARS:-20000} infer/data/corpus.txt)
  for o in layer-major chunked layer-major chunked; do
    log "prefill $o"
    timeout ${BENCH_S:-200} python3 -m infer.tools.bench --model "$W/q30" --budget ${BUDGET:-0.25} --runs 1 \
      --max-tokens 2 --modes ${MODES:-resident,iod} --prefill $o --prompt "$text" --raw-prompt \
      --json "$OUT/prefill-$o-$(date +%s).json" 2>&1 | grep -E "^(iod|resident|mode) "
  done ;;
profile)  # issue 48's host time a streamed layer: `infer run --profile` on q30 (after `q30`) at the
  # default cache (25%), device wait on and off; summary.md per layer in each folder.
  # PREFILL=1: the long prompt of `prefill` instead, 2 tokens (where a long prefill's time goes)
  prompt="def fibonacci(n):"; [ "${PREFILL:-0}" = 1 ] && prompt=$(head -c ${PROMPT_CHARS:-20000} infer/data/corpus.txt)
  for dw in ${DW:-on off}; do
    log "profile $dw"
    timeout ${BENCH_S:-200} python3 -m infer.cli run --model "$W/q30" --max-tokens ${TOKENS:-32} --ignore-chat-template \
      --prompt "$prompt" --device-wait $dw --profile "$OUT/prof-$dw" 2>&1 | tail -4
    rm -f "$OUT/prof-$dw/trace.json"
  done ;;
stackprobe)  # a compact stack's make / copy / compute on q30 (after `q30`): whether a long prefill's
  # new stacks (managed memory once their address is taken) cost the GPU more than kept ones
  for n in ${EXPERTS:-96 128}; do
    log "stack_probe $n"
    timeout ${BENCH_S:-200} python3 scripts/bench/stack_probe.py "$W/q30" --experts $n --tokens ${TOKENS:-2048} \
      --rounds ${ROUNDS:-5} --json "$OUT/stack-$n.json"
  done ;;
hang)  # the device wait's hang on MLX CUDA (docs/runtime.md): `infer run --device-wait on` on q30 (after
  # `q30`), and after HANG_S seconds every thread's Python and native stack (py-spy, from .gpu/w2)
  if watched ${HANG_S:-60} "$OUT/run.txt" python3 -m infer.cli run --model "$W/q30" --max-tokens 4 \
      --prompt "Hello" --device-wait on; then
    echo "no hang: $(grep -E '^Generation|Streamed layers' "$OUT/run.txt")"
  else
    grep -E "Thread|cuda|mlx|async_eval|copy" "$OUT/run.txt" | head -60
  fi ;;
bench14)  # issue 14: budget 1.0 warm (resident, iod), then sync and iod cold at each budget
  shift
  budgets=${*:-1.0 0.25 0.1 0.5}
  for b in $budgets; do
    if [ "$b" = 1.0 ]; then flags="--warm --modes ${MODES1:-resident,iod}"; else flags="--modes ${MODES:-sync,iod}"; fi
    log "bench $b $flags"
    timeout ${BENCH_S:-170} python3 -m infer.tools.bench --model "$W/q30" --budget "$b" --runs 1 --max-tokens 24 \
      $flags --json "$OUT/bench14-$b.json" 2>&1 | tail -8
  done ;;
train)  # issue 13: both architectures at the small preset, side by side
  M=${MINUTES:-7.5}
  for arch in ${ARCHS:-qwen3_moe qwen3_next}; do
    flags="${TRAIN_FLAGS:-}"
    # the preset's 16 sequences a step need the H200's memory: an H100 (80 GB) runs out at the first step
    mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
    case " $flags " in *" --batch "*) ;; *) [ "${mem:-0}" -lt 100000 ] && flags="$flags --batch 8" ;; esac
    log "train $arch $flags"
    infer train --arch $arch --preset small --corpus "${CORPUS:-/root/stash/corpus.txt}" --minutes "$M" --seed 0 \
      --dtype bfloat16 --no-judge --out "$W/t-$arch" --force $flags > "$OUT/train-$arch.log" 2>&1 &
  done
  wait
  for arch in ${ARCHS:-qwen3_moe qwen3_next}; do cp "$W/t-$arch/train.json" "$OUT/train-$arch.json"; tail -3 "$OUT/train-$arch.log"; done ;;
prep|trained|budgets)  # issues 13/15/17 on the trained small models: prep, routing, judging, budgets
  # prep: the prep folders alone; budgets: the benches alone (prep folders made before)
  if [ "$1" != budgets ]; then
    cal=$W/calibrate.txt  # training-distribution text (the corpus holds the stdlib), not the held-out text
    lib=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['stdlib'])")
    cat "$lib"/json/encoder.py "$lib"/textwrap.py "$lib"/shlex.py "$lib"/fractions.py > "$cal"
    for arch in ${ARCHS:-qwen3_moe qwen3_next}; do
      log "prep $arch"; infer prep --model "$W/t-$arch" --out "$W/p-$arch" --calibrate "$cal" --force 2>&1 | tail -1
      [ "$1" = prep ] && continue
      log "routing $arch"; infer routing --model "$W/p-$arch" --text "$W/t-$arch/heldout.txt" --tokens 1024 \
        --json "$OUT/routing-$arch.json" 2>&1 | tail -14
      # what `infer train` judges unless --no-judge: MTP acceptance, greedy samples
      log "eval $arch"; timeout ${EVAL_S:-150} python3 -c "import json, sys; from infer.train.eval import evaluate; \
json.dump(evaluate(sys.argv[1], open(sys.argv[1] + '/heldout.txt').read()), open(sys.argv[2], 'w'), indent=1)" \
        "$W/t-$arch" "$OUT/eval-$arch.json" && grep -A1 '"mtp_acceptance"\|"rate"' "$OUT/eval-$arch.json"
    done
  fi
  [ "$1" = prep ] && exit 0
  first=$(set -- ${ARCHS:-qwen3_moe qwen3_next}; echo "$1")  # the budgets are benched on the first
  budgets=${BUDGETS-1.0 0.5 0.25 0.1}  # BUDGETS= (empty): no benches
  [ -z "$budgets" ] || { log doctor; iod doctor --model "$W/p-$first" --seconds 1 --rounds 2 --json > "$OUT/doctor-small.json"; }
  for b in $budgets; do
    if [ "$b" = 1.0 ]; then flags="--warm --modes resident,iod"; else flags="--modes sync,iod"; fi
    log "bench $first $b $flags"
    timeout ${BENCH_S:-100} python3 -m infer.tools.bench --model "$W/p-$first" --budget "$b" --runs ${RUNS:-2} \
      --max-tokens 48 --prompt @pycode --raw-prompt $flags --json "$OUT/bench-$first-$b.json" 2>&1 | tail -6
  done ;;
spec)  # issue 17 on the trained small models: MTP resident and at 25%, n-gram on code; both exact verifies
  P="$W/p-qwen3_next"
  S="--runs ${RUNS:-2} --raw-prompt --max-tokens 8 --draft-tokens 64 --verify ${VERIFY:-exact,rowwise}"
  # SPECS: mtp-25 mtp-resident ngram (the default), ngram-25, rowab
  want() { case " ${SPECS:-mtp-25 mtp-resident ngram} " in *" $1 "*) return 0;; esac; return 1; }
  want mtp-25 && { log mtp-25; timeout ${SPEC_S:-150} python3 -m infer.tools.bench --model "$P" --modes iod --budget 0.25 $S --draft mtp \
    --num-draft ${KS:-1,2,3} --prompt @prose --json "$OUT/spec-mtp-25-${VERIFY:-both}.json" 2>&1 | tail -12; }
  want mtp-resident && { log mtp-resident; timeout ${SPEC_S:-150} python3 -m infer.tools.bench --model "$P" --modes resident $S --draft mtp \
    --num-draft ${KS:-1,2,3} --draft-check --prompt @prose --json "$OUT/spec-mtp-100-${VERIFY:-both}.json" 2>&1 | tail -12; }
  # n-gram: NGRAM_ARCH=qwen3_moe drafts on the trained qwen3_moe (prep it first), whose verify pass has
  # no gated-delta steps to take row by row
  want ngram && { log ngram; timeout ${SPEC_S:-150} python3 -m infer.tools.bench --model "$W/p-${NGRAM_ARCH:-qwen3_next}" \
    --modes resident $S --draft ngram --num-draft ${NGRAM_KS:-2,4} --draft-check --prompt @code \
    --json "$OUT/spec-ngram-${NGRAM_ARCH:-qwen3_next}-100.json" 2>&1 | tail -12; }
  want ngram-25 && { log ngram-25; timeout ${SPEC_S:-150} python3 -m infer.tools.bench --model "$W/p-${NGRAM_ARCH:-qwen3_next}" \
    --modes iod --budget 0.25 $S --draft ngram --num-draft ${NGRAM_KS:-2,4} --prompt @code \
    --json "$OUT/spec-ngram-${NGRAM_ARCH:-qwen3_next}-25.json" 2>&1 | tail -12; }
  # attention in one call where the probe allows it, against row by row, against plain (resident)
  want rowab && { log rowab; timeout ${SPEC_S:-150} python3 scripts/bench/rowwise_ab.py "$W/p-${NGRAM_ARCH:-qwen3_next}" @code \
    ${NGRAM_KS:-2,4} ${REPS:-4} 64 "$OUT/rowwise-ab.json" model; }
  log kernels; tar czf "$(dirname "$PACKED")/ptx.tgz" -C "$MLX_PTX_CACHE_DIR" .
  ;;
abq30)  # the working tree against AB_BASE (as `ab`) on q30 (after `q30`), alternating, ROUNDS rounds:
  # `abq30 prefill`: iod's prefill of the long prompt of `prefill` at BUDGET (ORDER: layer-major);
  # `abq30 decode`: iod's decode at BUDGET, routed as TRACE where it is there (carry .gpu/traces)
  tr=${TRACE:-$PWD/.gpu/traces/qwen.route.csv}
  what=${2:-prefill}
  case "$what" in
  prefill) args=(--max-tokens 2 --prefill "${ORDER:-layer-major}" --raw-prompt
                 --prompt "$(head -c ${PROMPT_CHARS:-20000} infer/data/corpus.txt)") ;;
  *) args=(--max-tokens 24); [ -f "$tr" ] && args+=(--routing-trace "$tr") ;;
  esac
  one() {
    (cd "$3" && PYTHONPATH=/tmp/site:$3 timeout ${BENCH_S:-200} python3 -m infer.tools.bench \
      --model "$W/q30" --budget ${BUDGET:-0.25} --modes iod --runs 1 "${args[@]}" \
      --json "$OUT/abq30-$what-$1-$2.json" 2>&1 | grep -E "^iod  ")
  }
  alternate one ;;
abrun)  # the working tree against AB_BASE on q30 (after `q30`), alternating, ROUNDS rounds: `infer run`
  # of the warm-up's prompt (no kernel left to compile), TOKENS tokens at the default cache; each
  # side's text must be the same (greedy); PROFILE=1: then one `--profile` run of the working tree
  one() {
    (cd "$3" && PYTHONPATH=/tmp/site:$3 timeout ${BENCH_S:-100} python3 -m infer.cli run --model "$W/q30" \
      --max-tokens ${TOKENS:-32} --prompt "Hello" > "$OUT/run-$1-$2.txt" 2>&1)
    grep -E "^Generation|waiting for records" "$OUT/run-$1-$2.txt"
  }
  alternate one
  for f in "$OUT"/run-*.txt; do awk '/^==========$/{n++; next} n==1' "$f" | md5sum; done | sort | uniq -c  # (one line: the same text)
  if [ "${PROFILE:-0}" = 1 ]; then
    log profile; timeout ${BENCH_S:-100} python3 -m infer.cli run --model "$W/q30" --max-tokens ${TOKENS:-32} \
      --prompt "Hello" --profile "$OUT/prof" 2>&1 | grep -E "^Generation"
    python3 -c "import json; d = json.load(open('$OUT/prof/summary.json')); print(d['all_hit_host_us'], d.get('decode_ms_per_token'))"
  fi ;;
ab)  # the working tree against an older copy of the code (AB_BASE, a folder holding infer/ iod/ shared/
  # native/), alternating, on the trained model: `infer bench` at BUDGET and PREDICT, ROUNDS rounds of each
  one() {
    (cd "$3" && PYTHONPATH=/tmp/site:$3 timeout ${BENCH_S:-100} python3 -m infer.tools.bench \
      --model "$W/p-${ARCH:-qwen3_next}" --budget ${BUDGET:-0.25} --modes ${MODES:-iod} --runs ${RUNS:-3} \
      --predict ${PREDICT:-auto} --max-tokens ${TOKENS:-48} --prompt @pycode --raw-prompt --json "$OUT/ab-$1-$2.json" 2>&1 | tail -3)
  }
  alternate one ;;
gate)  # the prediction gate (infer/runtime/gate.py): iod with prediction on, measured (auto) and off (beside
  # sync), long enough for the gate to probe; the order reversed every round
  for r in $(seq ${ROUNDS:-1}); do for b in ${BUDGETS:-0.25 0.5}; do
    order=${PREDICTS:-on auto off}; [ $((r % 2)) = 0 ] && order=$(echo $order | tr ' ' '\n' | tac | xargs)
    for p in $order; do
      modes=iod; [ $p = off ] && modes=sync,iod
      log "round $r budget $b predict $p"
      timeout ${BENCH_S:-150} python3 -m infer.tools.bench --model "$W/p-${ARCH:-qwen3_next}" --budget $b --modes $modes \
        --predict $p --runs ${RUNS:-2} --max-tokens ${TOKENS:-160} --prompt @pycode --raw-prompt \
        --json "$OUT/gate-$r-$b-$p.json" 2>&1 | tail -3
    done
  done; done ;;
depth)  # prediction's host cost against its depth: --predict on at depths 1 and 3, and off, alternating
  for r in $(seq ${ROUNDS:-2}); do for b in ${BUDGETS:-0.25 0.1}; do
    for d in ${DEPTHS:-1 3 0}; do
      p=on; [ $d = 0 ] && p=off && d=3
      log "round $r budget $b predict $p depth $d"
      timeout ${BENCH_S:-90} python3 -m infer.tools.bench --model "$W/p-${ARCH:-qwen3_next}" --budget $b --modes iod \
        --predict $p --depth $d --runs 1 --max-tokens ${TOKENS:-160} --prompt @pycode --raw-prompt \
        --json "$OUT/depth-$r-$b-$p-$d.json" 2>&1 | tail -1
    done
  done; done ;;
hitsab)  # A/B of a token's cached experts computed while its misses are read (--hits-first on|off)
  log prep-tiny; infer prep --model tests/models/tiny-trained-qwen3_moe --out "$W/tiny" --force --no-progress | tail -1
  log warm; infer run --model "$W/tiny" --max-tokens 4 --prompt Hello > /dev/null
  # one bench (2 modes x 2 runs of 64 tokens) took over 60 s on the H200: 8 do not fit a call
  for r in $(seq ${ROUNDS:-1}); do for b in ${BUDGETS:-0.5 0.25}; do for f in on off; do
    log "round $r budget $b hits-first $f"
    timeout ${BENCH_S:-120} python3 -m infer.tools.bench --model "$W/tiny" --budget "$b" --modes sync,iod --runs 2 \
      --max-tokens 64 --hits-first $f --json "$OUT/ab-$r-$b-$f.json" 2>&1 | tail -3
  done; done; done ;;
ship)  # bring a folder of $W back in pieces: PART=0 packs and sends pieces 0-3, PART=4 sends 4-7, ...
  # (a call returns at most 64 MiB; here: cat part.* | tar xf -, in name order, after sha256sum -c)
  src=${SHIP:-t-qwen3_next}
  part=${PART:-0}
  if [ "$part" = 0 ]; then
    rm -rf /root/parts && mkdir -p /root/parts
    tar cf - -C "$W" "$src" | split -b 16000000 -a 3 -d - /root/parts/part.
    ls /root/parts | wc -l > "$OUT/count.txt"; (cd /root/parts && sha256sum part.*) > "$OUT/sha256.txt"
  fi
  ls /root/parts | sed -n "$((part + 1)),$((part + 4))p" | while read -r f; do cp "/root/parts/$f" "$(dirname "$PACKED")/"; done
  echo "pieces $(ls /root/parts | wc -l), sent from $part" ;;
tinyspec)  # exactness of drafting under streaming on the GPU, on the committed tiny-trained qwen3_next
  log prep; infer prep --model tests/models/tiny-trained-qwen3_next --out "$W/tn" --force --no-progress | tail -1
  log bench; timeout ${SPEC_S:-400} python3 -m infer.tools.bench --model "$W/tn" --modes resident,sync,iod --budget 0.25 \
    --runs 1 --raw-prompt --max-tokens 8 --draft-tokens 48 --verify exact,rowwise --draft mtp --num-draft 1,2 \
    --draft-check --prompt @prose --json "$OUT/tinyspec.json" 2>&1 | tail -16 ;;
overhead)  # where a streamed layer's time goes: tiny-trained qwen3_moe and the small preset (random)
  log prep-tiny; infer prep --model tests/models/tiny-trained-qwen3_moe --out "$W/tiny" --force --no-progress | tail -1
  if [ ! -f "$W/small/manifest.json" ]; then
    log synth-small; time infer synth --arch qwen3_moe --preset small --dtype bfloat16 --out "$W/small-src" --force | tail -1
    log prep-small; time infer prep --model "$W/small-src" --out "$W/small" --force --no-progress | tail -1
    rm -rf "$W/small-src"
  fi
  log doctor; iod doctor --model "$W/small" --seconds 1 --rounds 2 --json > "$OUT/doctor-small.json"
  [ -n "${NO_WARM:-}" ] || for m in tiny small; do log "warm $m"; time infer run --model "$W/$m" --max-tokens 4 --prompt Hello > /dev/null; done
  ;;
split)  # the profile's split of a decode token, and the per-layer cost in bench (NO_BENCH=1: profiles alone)
  for m in ${MODELS:-tiny small}; do
    log "profile $m"
    timeout 120 python3 -m infer.cli run --model "$W/$m" --prompt "def fibonacci(n):" --max-tokens ${TOKENS:-48} \
      --json --profile "$OUT/prof-$m" > "$OUT/run-$m.json" 2> "$OUT/run-$m.err"
    sed -n '/A decode token/,/^| [0-9]/p' "$OUT/prof-$m/summary.md"
  done
  [ -n "${NO_BENCH:-}" ] || {
  log "bench tiny"
  timeout 150 python3 -m infer.tools.bench --model "$W/tiny" --budget 0.5 --modes resident,sync,iod \
    --runs 3 --max-tokens 64 --json "$OUT/bench-tiny.json" 2>&1 | tail -4
  log "bench small"
  timeout 150 python3 -m infer.tools.bench --model "$W/small" --budget 0.5 --modes sync,iod \
    --runs 2 --max-tokens 32 --json "$OUT/bench-small.json" 2>&1 | tail -3; }
  log "kernels"
  tar czf "$(dirname "$PACKED")/ptx.tgz" -C "$MLX_PTX_CACHE_DIR" . ;;
esac
