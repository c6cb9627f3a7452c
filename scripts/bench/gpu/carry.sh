#!/usr/bin/env bash
# Everything a GPU run carries, made from nothing here (each git-ignored under .gpu/):
#   w1, w2   the wheels (wheels.sh), made only where w1 is missing
#   base     BASE_REV's infer/ iod/ shared/ native/, the older side of the A/B steps (AB_BASE)
#   traces   the recorded Qwen3-30B-A3B routing (third-party: copied from ../shared, never committed)
#   usage (project root): scripts/bench/gpu/carry.sh [BASE_REV]   (default HEAD~1)
set -euo pipefail
cd "$(dirname "$0")/../../.."
[ -f .gpu/w1/mlxcuda.part00 ] || bash scripts/bench/gpu/wheels.sh
rm -rf .gpu/base && mkdir -p .gpu/base
git archive "${1:-HEAD~1}" infer iod shared native | tar -x -C .gpu/base
trace=../shared/routing_traces/BigMoeOnEdge/qwen.route.csv
if [ -f "$trace" ]; then mkdir -p .gpu/traces && cp "$trace" .gpu/traces/; fi
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
du -sh .gpu/*
