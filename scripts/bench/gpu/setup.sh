#!/usr/bin/env bash
# On a lent GPU machine, in the copy of the working tree: the part stashed by
# the first call (/root/stash, from .gpu/w1) plus .gpu/w2 (wheels.sh), installed
# into /tmp/site; the native extension built in place.
# Then: export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail
cd "$(dirname "$0")/../../.."
name=$(cat .gpu/w2/mlxcuda.name)
cat /root/stash/mlxcuda.part00 .gpu/w2/mlxcuda.part01 > "/tmp/$name"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "/tmp/$name" .gpu/w2/*.whl
python3 setup.py -q build_ext --inplace >/dev/null 2>&1 || python3 setup.py build_ext --inplace
export PYTHONPATH=/tmp/site:$PWD
python3 -c "import mlx.core as mx, mlx_lm, zmq, native; print('mlx', mx.__version__, mx.default_device(), 'zmq', zmq.__version__)"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
df -h / /tmp /root 2>/dev/null | sort -u
