#!/usr/bin/env bash
# On the lent H200, in the copy of the working tree: the wheels stashed by the
# first calls (/root/stash) plus .gpu/w3, installed into /tmp/site; the native
# extension built in place. Then: export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail
cd "$(dirname "$0")/../../.."
cp .gpu/w3/mlxcuda.part02 /root/stash/
name=$(cat .gpu/w3/mlxcuda.name)
cat /root/stash/mlxcuda.part00 /root/stash/mlxcuda.part01 /root/stash/mlxcuda.part02 > "/tmp/$name"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "/tmp/$name" .gpu/w3/*.whl
python3 setup.py -q build_ext --inplace >/dev/null 2>&1 || python3 setup.py build_ext --inplace
export PYTHONPATH=/tmp/site:$PWD
python3 -c "import mlx.core as mx, mlx_lm, zmq, native; print('mlx', mx.__version__, mx.default_device(), 'zmq', zmq.__version__)"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
df -h / /tmp /root 2>/dev/null | sort -u
