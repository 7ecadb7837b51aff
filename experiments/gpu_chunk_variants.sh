#!/usr/bin/env bash
# One device call: time the XLA chunk form's variants (inverse method x matmul precision) on the GPU.
set -u -o pipefail
OUT=${OUT:-gpu_logs}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { tail "$OUT/install.log"; exit 1; }
SIZES=${SIZES:-8x2048x16x128,1x32768x16x128}
for variant in "blocked auto" "solve auto" "blocked highest" "solve highest"; do
  set -- $variant
  timeout ${VARIANT_TIMEOUT:-100} python3 experiments/bench_rules.py --rule=gated_deltanet --impls=chunk,chunk_assoc \
    --sizes="$SIZES" --chunk_inverse=$1 --chunk_precision=$2 --iters=5 2>&1 | grep -v -i warning | grep "^|\|^#" \
    | tee -a "$OUT/chunk_variants.log"
done
