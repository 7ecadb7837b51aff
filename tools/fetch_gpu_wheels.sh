#!/usr/bin/env bash
# Downloads the wheels that the GPU machine lacks into .whl/ (ignored by git; pass it in the device call's carry
# list). The GPU machine has jax, flax, optax, orbax, absl and numpy but not grain; the device scripts
# (experiments/gpu_reproduce.sh, experiments/gpu_train_parallel.sh) install .whl/*.whl with --no-deps into
# /tmp/site when `import grain` fails there; experiments/gpu_check.sh installs pytest-xdist from them to run the
# GPU tests in parallel. Its Python is CPython 3.12 on x86-64 Linux.
#   bash tools/fetch_gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
mkdir -p .whl
"$PY" -m pip download -q --dest .whl --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --abi cp312 --abi none --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_28_x86_64 --platform any \
  grain==0.2.18 array-record==0.8.6 portpicker==1.6.0 cloudpickle==3.1.2 pytest-xdist==3.8.0 execnet==2.1.2
ls -l .whl
