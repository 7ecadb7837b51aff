#!/usr/bin/env bash
# One device call: install the repo, run the GPU tests of the Pallas kernels, time them.
#   MODE=all (default) or a comma list of sweep, precision, tests, kda_tests, bench, kda_bench, memory,
#   ptx_check, mosaic_tests, bytes;  logs go to $OUT (or ./gpu_logs).
#   The Hopper kernels (impl="mosaic"): MODE=bench,kda_bench,ptx_check BENCH_IMPLS=mosaic KDA_BENCH_IMPLS=mosaic
#   BENCH_SIZES=8x2048x16x128,1x32768x16x128 BENCH_EXTRA=--bandwidth_gbs=4300 (~4 min on an H200), then
#   MODE=mosaic_tests (~5 min with 8 TEST_WORKERS); together they come near one device call's 10-minute limit.
set -u -o pipefail
OUT=${OUT:-gpu_logs}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
MODE=${MODE:-all}
SWEEP_VARIANTS=${SWEEP_VARIANTS:-default}
SWEEP_SIZES=${SWEEP_SIZES:-8x2048x16x128}
BENCH_SIZES=${BENCH_SIZES:-8x2048x16x128,2x8192x16x128,1x32768x16x128}
BENCH_IMPLS=${BENCH_IMPLS:-chunk,chunk_assoc,pallas}
want() { [[ $MODE == all || ",$MODE," == *",$1,"* ]]; }
# The GPU tests compile Triton kernels per test, on the CPU: one test at a time took 230 s for 8 tests (H100,
# 2026-11-23). With pytest-xdist (its wheels carried in .whl/, tools/fetch_gpu_wheels.sh) TEST_WORKERS processes
# compile side by side on the machine's 16 cores.
PARALLEL=""
if ! python3 -c "import xdist" >/dev/null 2>&1 && compgen -G ".whl/pytest_xdist-*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/xdist_site .whl/pytest_xdist-*.whl \
    .whl/execnet-*.whl >>"$OUT/install.log" 2>&1 && export PYTHONPATH=/tmp/xdist_site${PYTHONPATH:+:$PYTHONPATH}
fi
if python3 -c "import xdist" >/dev/null 2>&1; then PARALLEL="-n ${TEST_WORKERS:-6}"; fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
  || { echo "editable install failed, see install.log"; tail -5 "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv | tee "$OUT/device.txt"
python3 -c "import jax, deltajax; print(jax.__version__, jax.devices(), sorted(deltajax.rules.dispatch.implementations('delta_rule')))" | tee -a "$OUT/device.txt"
if want sweep; then
  timeout ${SWEEP_TIMEOUT:-200} python3 experiments/bench_pallas_gpu.py --sizes="$SWEEP_SIZES" --variants="$SWEEP_VARIANTS" ${SWEEP_EXTRA:-} 2>&1 \
    | grep --line-buffered -v Warning | tee "$OUT/sweep.log"
fi
if want precision; then
  timeout ${PRECISION_TIMEOUT:-120} python3 experiments/kernel_precision.py --size="${PRECISION_SIZE:-2x1024x2x128}" \
    --variants="${PRECISION_VARIANTS:-default}" ${PRECISION_EXTRA:-} 2>&1 | grep --line-buffered -v Warning | tee "$OUT/precision.log"
fi
if want tests; then
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider $PARALLEL tests/kernels/test_gpu_wy_chunk.py -k "${TESTS:-gpu_bf16 or gpu_fp16 or gpu_fp32 or gpu_adversarial or gpu_dispatch}" \
    -rA --tb=short ${PYTEST_EXTRA:-} 2>&1 | tee "$OUT/pytest.log" | grep -E "PASS|FAIL|Error|error|assert|passed|failed"
fi
if want kda_tests; then
  timeout ${KDA_TEST_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider $PARALLEL tests/kernels/test_gpu_kda.py -k "${KDA_TESTS:-gpu_bf16 or gpu_fp32 or gpu_adversarial or gpu_dispatch or compiled}" \
    -rA --tb=short 2>&1 | tee "$OUT/pytest_kda.log" | grep -E "PASS|FAIL|Error|error|assert|passed|failed"
fi
if want bench; then
  timeout ${BENCH_TIMEOUT:-240} python3 experiments/bench_rules.py --rule=gated_deltanet --impls="$BENCH_IMPLS" \
    --sizes="$BENCH_SIZES" ${BENCH_EXTRA:-} 2>&1 | grep --line-buffered -v Warning | tee "$OUT/bench.log"
fi
if want kda_bench; then
  timeout ${KDA_BENCH_TIMEOUT:-200} python3 experiments/bench_rules.py --rule=kda --impls="${KDA_BENCH_IMPLS:-pallas}" \
    --sizes="$BENCH_SIZES" ${BENCH_EXTRA:-} 2>&1 | grep --line-buffered -v Warning | tee "$OUT/bench_kda.log"
fi
if want memory; then
  timeout ${MEMORY_TIMEOUT:-200} python3 experiments/bench_rules.py --rule=gated_deltanet --impls=pallas \
    --sizes=1x65536x16x128 --peak_memory --timing=each --warmup=1 --iters=3 2>&1 | grep --line-buffered -v Warning | tee "$OUT/memory.log"
fi
# The Mosaic GPU (Hopper) kernels: their PTX checked for accumulator reads that make ptxas serialize wgmmas (note
# C7514; docs/mosaic.md, "Serialized wgmmas"), then their compiled tests. (Time them with the bench modes above.)
if want ptx_check; then
  for rule in gated_deltanet kda; do
    dump=$(mktemp -d)
    MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO="$dump" timeout ${PTX_TIMEOUT:-120} \
      python3 experiments/bench_rules.py --rule=$rule --impls=mosaic --sizes=8x2048x16x128 --iters=1 \
      >"$OUT/ptx_$rule.log" 2>&1
    if compgen -G "$dump/*.ptx" >/dev/null; then
      python3 experiments/wgmma_reads.py "$dump"/*.ptx 2>&1 | tee -a "$OUT/ptx_check.log" | grep -v "PTX line"
    else
      echo "$rule: no PTX dumped (see $OUT/ptx_$rule.log)" | tee -a "$OUT/ptx_check.log"
    fi
    cat "$dump"/*.ptxas 2>/dev/null | grep -E "C751|spill|Used" | sort | uniq -c | tee -a "$OUT/ptx_check.log"
    rm -rf "$dump"
  done
fi
# Every kernel's device time and DRAM bytes in a warm training step of each rule at BYTES_SIZE (Nsight Compute; the
# tables of docs/benchmarks.md, "Where a training step's bytes go on the H100"), with its registers per thread and
# local-memory (spill) sectors (docs/kernels.md, "KDA: the fused gradient kernel's end reordered"). Kernels of the
# first call and the inputs' own fusions are in the CSV too: read the last call's rows. Not part of MODE=all (it
# needs Nsight Compute). BYTES_DTYPE=float16 (or float32) profiles the Triton kernels, which "auto" runs for them.
if [[ ",$MODE," == *",bytes,"* ]]; then
  out=$(cd "$OUT" && pwd)
  SPILL_METRICS=launch__registers_per_thread,l1tex__t_sectors_pipe_lsu_mem_local_op_ld.sum
  SPILL_METRICS+=,l1tex__t_sectors_pipe_lsu_mem_local_op_st.sum
  for rule in ${BYTES_RULES:-gated_deltanet kda}; do
    dtype=${BYTES_DTYPE:-bfloat16}
    if [[ $dtype != bfloat16 ]]; then
      if [[ $rule == kda ]]; then profile="profile_kda_gpu.py --config=default --dtype=$dtype"
      else profile="profile_wy_gpu.py --dtype=$dtype"; fi
    elif [[ $rule == kda ]]; then profile="profile_kda_gpu.py --config=mosaic"
    else profile="profile_mosaic_gpu.py --backward"; fi
    profile_with() {  # metrics, CSV name
      (cd experiments && timeout ${BYTES_TIMEOUT:-250} ncu --clock-control none --csv --metrics "$1" python3 $profile \
        --calls=2 --size=${BYTES_SIZE:-8x2048x16x128} >"$out/$2.csv" 2>"$out/$2.err")
    }
    if ! profile_with gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,$SPILL_METRICS bytes_$rule; then
      # ncu itself crashed (segmentation fault) on KDA's squares-first gradient kernel with all six metrics and ran
      # without dram__bytes_read.sum (H100, 2026-12-06): then the metrics in two runs.
      echo "$rule: ncu failed with all metrics; again in two runs (bytes_$rule.csv, spills_$rule.csv)"
      profile_with gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum bytes_$rule
      profile_with gpu__time_duration.sum,$SPILL_METRICS spills_$rule
    fi
    echo "$rule: $(grep -c dram__bytes_read "$out/bytes_$rule.csv") kernels profiled, $out/bytes_$rule.csv"
  done
fi
if want mosaic_tests; then
  # Each process allocating only what it uses (the pooled allocator of several processes runs out of GPU memory);
  # never time on it (docs/mosaic.md, "A timing trap").
  XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout ${MOSAIC_TEST_TIMEOUT:-360} python3 -m pytest -q -p no:cacheprovider \
    $PARALLEL -rf \
    tests/kernels/test_mosaic_{wy,wy_grads,wy_reverse,kda,kda_grads,vectors}.py -k gpu 2>&1 \
    | tee "$OUT/pytest_mosaic.log" | grep -E "FAIL|Error|passed|failed"
fi
