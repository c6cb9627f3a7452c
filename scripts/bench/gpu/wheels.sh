#!/usr/bin/env bash
# Wheels for the lent GPU machines (Python 3.12, no network there), in two
# parts so each call's payload (the working tree, ~12 MB, plus one part)
# stays under the device tool's 64 MiB: .gpu/w1 holds the first 48 MB of MLX's
# CUDA wheel, .gpu/w2 the rest, its name and the other wheels (pytest's too,
# for tests/test_device_wait.py; py-spy, for the native stacks of a hang).
# Git-ignored.
#   usage (project root): scripts/bench/gpu/wheels.sh
#   there: a call carrying .gpu/w1: mkdir -p /root/stash && cp .gpu/w1/* /root/stash/
#          the next, carrying .gpu/w2: bash scripts/bench/gpu/setup.sh && ...
set -euo pipefail
cd "$(dirname "$0")/../../.."
plat="--platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64"
dl=$(mktemp -d)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $plat \
  -d "$dl" mlx==0.32.4 mlx-cuda-13==0.32.4 mlx-lm==0.32.2 pyzmq msgpack greenlet pytest pluggy iniconfig packaging pygments py-spy
rm -rf .gpu/w1 .gpu/w2; mkdir -p .gpu/w1 .gpu/w2
wheel=$(ls "$dl"/mlx_cuda_13-*.whl)
split -b 48000000 -d "$wheel" "$dl/part"
mv "$dl/part00" .gpu/w1/mlxcuda.part00
mv "$dl/part01" .gpu/w2/mlxcuda.part01
basename "$wheel" > .gpu/w2/mlxcuda.name
find "$dl" -name '*.whl' ! -name 'mlx_cuda_13-*' -exec mv {} .gpu/w2/ \;
rm -rf "$dl"
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
du -sh .gpu/w1 .gpu/w2
