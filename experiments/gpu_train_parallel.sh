#!/usr/bin/env bash
# One device call on a machine with several GPUs: the same training run data parallel, then sequence parallel.
# Needs grain's wheels carried in .whl (tools/fetch_gpu_wheels.sh); logs and metrics go to $OUT (or ./gpu_logs).
#   STEPS=150 PRESET=hybrid-small-bytes bash experiments/gpu_train_parallel.sh
set -u -o pipefail
OUT=${OUT:-gpu_logs}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
  || { echo "editable install failed"; tail -5 "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/device.txt"
python3 -c "import jax, grain; print(jax.__version__, jax.devices())" | tee -a "$OUT/device.txt"
PRESET=${PRESET:-hybrid-small-bytes}
STEPS=${STEPS:-150}
COMMON="--preset=$PRESET --steps=$STEPS --eval_every=$STEPS --eval_batches=2 --checkpoint_every=0 --log_every=10
        --warmup_steps=20 --progress_bar=false ${EXTRA:-}"
for mode in ${MODES:-dp sp}; do
  case $mode in
    dp) par="--sequence_parallel=1" ;;
    sp) par="--sequence_parallel=${SP:-2}" ;;
  esac
  echo "== $mode: $par"
  timeout ${RUN_TIMEOUT:-240} python3 experiments/train.py $COMMON $par --run_dir="$OUT/$mode" 2>&1 \
    | grep -v -i warning | tee "$OUT/$mode.log" | tail -${TAIL:-12}
done
# Throughput: median of the logged train windows after the first (which holds the compilation).
python3 - "$OUT" ${MODES:-dp sp} <<'PY' | tee "$OUT/summary.txt"
import json, statistics, sys
out, modes = sys.argv[1], sys.argv[2:]
print(f"{'run':4} {'tokens/s':>12} {'MFU':>7} {'final loss':>10} {'eval ppl@1x':>11} {'eval ppl@2x':>11}")
for mode in modes:
    try:
        rows = [json.loads(line) for line in open(f"{out}/{mode}/metrics.jsonl")]
    except OSError:
        print(f"{mode:4} (no metrics)"); continue
    train = [r for r in rows if r["kind"] == "train"][1:]
    evals = [r for r in rows if r["kind"] == "eval"]
    tps = statistics.median(r["tokens_per_s"] for r in train) if train else float("nan")
    mfu = [r["mfu"] for r in train if r.get("mfu")]
    mfu = f"{statistics.median(mfu):.3f}" if mfu else "n/a"
    e = evals[-1] if evals else {}
    print(f"{mode:4} {tps:12,.0f} {mfu:>7} {train[-1]['loss'] if train else float('nan'):10.4f} "
          f"{e.get('eval_perplexity@1x', float('nan')):11.3f} {e.get('eval_perplexity@2x', float('nan')):11.3f}")
PY
