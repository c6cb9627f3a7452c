#!/usr/bin/env bash
# Wheels for the lent H200 (Python 3.12, no network there), in parts of at most
# 30 MB so each call's payload (the working tree plus one part) stays under the
# device tool's 64 MiB. Fills .gpu/w1 .gpu/w2 .gpu/w3 (git-ignored).
#   usage (project root): scripts/bench/gpu/wheels.sh
set -euo pipefail
cd "$(dirname "$0")/../../.."
plat="--platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
dl=$(mktemp -d)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $plat \
  -d "$dl" mlx==0.32.4 mlx-cuda-13==0.32.4 mlx-lm==0.32.2 pyzmq
rm -rf .gpu/w1 .gpu/w2 .gpu/w3; mkdir -p .gpu/w1 .gpu/w2 .gpu/w3
wheel=$(ls "$dl"/mlx_cuda_13-*.whl)
split -b 30000000 -d "$wheel" "$dl/part"
mv "$dl/part00" .gpu/w1/mlxcuda.part00
mv "$dl/part01" .gpu/w2/mlxcuda.part01
mv "$dl/part02" .gpu/w3/mlxcuda.part02
basename "$wheel" > .gpu/w3/mlxcuda.name
find "$dl" -name '*.whl' ! -name 'mlx_cuda_13-*' -exec mv {} .gpu/w3/ \;
rm -rf "$dl"
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
du -sh .gpu/w1 .gpu/w2 .gpu/w3
