#!/usr/bin/env bash
# One device call (one H100, at most 10 minutes): the research reproductions of docs/results.md sections 1-3 at
# GPU scale, inside a total wall budget (default 540 s, install and compilation included).
#
#   bash tools/fetch_gpu_wheels.sh                 # once, here: grain's wheels into .whl/ (carried)
#   OUT=$OUT bash experiments/gpu_reproduce.sh     # on the device; results in $OUT/results, logs in $OUT
#   SCALE=smoke OUT=/tmp/repro PYTHON=.venv/bin/python bash experiments/gpu_reproduce.sh   # CPU check, minutes
#
# Jobs, all on the one GPU at the same time (separate processes: compilation and the Python-built synthetic
# batches overlap the other jobs' GPU work):
#   state tracking  parity, DeltaNet / Gated DeltaNet with beta in [0, 1] and [0, 2]; 2 layers, d_model 128,
#                   train length 40 (scored 3-40), test 40-256; batch 256, at most 5000 steps; float32.
#                   Two processes of two runs each.
#   MQAR            Zoology: vocabulary 8192, sequence 512, 64 key-value pairs, 2 layers; Gated DeltaNet,
#                   DeltaNet, linear attention, KDA at d_model 64, 128, 256; batch 128, at most 4000 steps,
#                   AdamW 1e-3; bfloat16 compute. One process per width.
#   LM              (after the state-tracking processes, in the time left) byte-level LM on the Python stdlib,
#                   5 step-size variants, d_model 256, 4 layers, 2 heads of 128, length 512, batch 32, 600 steps
#                   (equal tokens), bfloat16. Skipped when less than LM_MIN_S seconds are left.
# Every run of the synthetic tasks fits its learning-rate schedule to the steps that fit its share of the job's
# --time_budget_s (experiments/_synthetic.py) and every job runs under `timeout`; JSON records are written after
# every run, so a job cut short keeps the runs it finished. Environment overrides: SCALE (gpu | smoke), OUT,
# PYTHON, TOTAL_S, JOB_S (budget of each state-tracking and MQAR job), ST_JOB_S, MQAR_JOB_S, SERIAL (1: one job
# at a time; set by itself when the GPU is in an exclusive compute mode), LM (0: skip), LM_MIN_S, GRACE_S, and the
# argument strings ST_ARGS, ST_GROUPS, MQAR_ARGS, MQAR_WIDTHS, LM_ARGS.
set -u -o pipefail
T0=$(date +%s)
OUT=${OUT:-gpu_logs}
RES="$OUT/results"
mkdir -p "$RES/parts"
PY=${PYTHON:-python3}
SCALE=${SCALE:-gpu}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false TF_CPP_MIN_LOG_LEVEL=2
now() { echo $(( $(date +%s) - T0 )); }

case $SCALE in
  gpu)
    TOTAL_S=${TOTAL_S:-540}; JOB_S=${JOB_S:-330}; LM_MIN_S=${LM_MIN_S:-100}; GRACE_S=${GRACE_S:-45}
    ST_ARGS=${ST_ARGS:-"--tasks=parity --d_model=128 --n_layers=2 --train_len=40 --min_len=3 --test_len=256
      --steps=5000 --batch_size=256 --learning_rate=3e-3 --eval_batches=4 --compute_dtype=float32 --data_workers=3"}
    MQAR_ARGS=${MQAR_ARGS:-"--vocab_size=8192 --seq_len=512 --num_kv_pairs=64 --n_layers=2
      --variants=gated_deltanet,deltanet,linear_attention,kda --steps=4000 --batch_size=128 --learning_rate=1e-3
      --eval_batches=4 --compute_dtype=bfloat16 --data_workers=4"}
    MQAR_WIDTHS=${MQAR_WIDTHS:-"64 128 256"}
    LM_ARGS=${LM_ARGS:-"--d_model=256 --n_layers=4 --n_heads=2 --seq_len=512 --batch_size=32 --steps=600
      --learning_rate=1e-3 --eval_every=300 --eval_batches=4 --compute_dtype=bfloat16"}
    ;;
  smoke)
    TOTAL_S=${TOTAL_S:-280}; JOB_S=${JOB_S:-100}; LM_MIN_S=${LM_MIN_S:-30}; GRACE_S=${GRACE_S:-60}
    ST_ARGS=${ST_ARGS:-"--tasks=parity --d_model=16 --train_len=16 --min_len=3 --test_len=32 --steps=400
      --batch_size=8 --eval_batches=1 --data_workers=1"}
    MQAR_ARGS=${MQAR_ARGS:-"--vocab_size=64 --seq_len=32 --num_kv_pairs=4 --variants=gated_deltanet --steps=400
      --batch_size=8 --eval_batches=1 --data_workers=1"}
    MQAR_WIDTHS=${MQAR_WIDTHS:-"16 32"}
    LM_ARGS=${LM_ARGS:-"--variants=gated_deltanet,gdn_longhorn --d_model=16 --n_layers=1 --seq_len=32
      --batch_size=4 --steps=40 --eval_every=0 --eval_batches=1"}
    ;;
  *) echo "SCALE must be gpu or smoke, got $SCALE"; exit 2 ;;
esac
ST_GROUPS=${ST_GROUPS:-"deltanet,deltanet_neg gated_deltanet,gated_deltanet_neg"}
LM=${LM:-1}

# grain from the carried wheels (only where it is missing), then the repository (only where not installed).
if ! $PY -c "import grain" >/dev/null 2>&1; then
  if ! compgen -G ".whl/*.whl" >/dev/null; then
    echo "grain is not installed and .whl/ holds no wheels: run tools/fetch_gpu_wheels.sh and carry .whl"; exit 1
  fi
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >"$OUT/install.log" 2>&1 || { echo "wheel install failed"; tail -5 "$OUT/install.log"; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if ! $PY -c "import deltajax.kernels" >/dev/null 2>&1; then
  $PY -m pip install -q --no-deps --no-build-isolation -e . >>"$OUT/install.log" 2>&1 \
    || { echo "editable install failed"; tail -5 "$OUT/install.log"; exit 1; }
fi
{ command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,compute_mode --format=csv
  $PY -c "import jax, grain, deltajax; print('jax', jax.__version__, jax.devices())"
  $PY -c "import matplotlib" 2>/dev/null || echo "matplotlib missing: no plots"; } 2>&1 | tee "$OUT/device.txt"
# Concurrent jobs need a GPU that takes several processes; in an exclusive compute mode run them one at a time.
if [ -z "${SERIAL:-}" ]; then
  SERIAL=0
  if command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=compute_mode --format=csv,noheader | grep -qi exclusive
  then SERIAL=1; fi
fi
if [ "$SERIAL" = 1 ]; then  # the same work in sequence: smaller shares, the LM comparison only if time is left
  ST_JOB_S=${ST_JOB_S:-$((JOB_S * 2 / 9))}; MQAR_JOB_S=${MQAR_JOB_S:-$((JOB_S * 2 / 9))}
else
  ST_JOB_S=${ST_JOB_S:-$JOB_S}; MQAR_JOB_S=${MQAR_JOB_S:-$JOB_S}
fi
echo "[$(now) s] installed; scale $SCALE, serial $SERIAL; state-tracking jobs get ${ST_JOB_S} s, MQAR jobs" \
  "${MQAR_JOB_S} s, total budget ${TOTAL_S} s"

# job NAME TIMEOUT_S CMD...: runs CMD under timeout, output to $OUT/NAME.log; exit status and seconds to NAME.rc.
job() {
  local name=$1 limit=$2 start; shift 2
  start=$(date +%s)
  timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  echo "$? $(( $(date +%s) - start ))" >"$OUT/$name.rc"
  echo "[$(now) s] $name done (exit $(cut -d' ' -f1 "$OUT/$name.rc"), $(cut -d' ' -f2 "$OUT/$name.rc") s)"
}
launch() { if [ "$SERIAL" = 1 ]; then job "$@"; else job "$@" & fi; }

state_tracking_jobs() {
  local i=0 group
  for group in $ST_GROUPS; do
    i=$((i + 1))
    launch st$i $((ST_JOB_S + GRACE_S)) $PY experiments/state_tracking.py $ST_ARGS --variants="$group" \
      --time_budget_s="$ST_JOB_S" --out="$RES/parts/state_tracking_$i.json" --plot=
  done
  wait
}

mqar_jobs() {
  local width
  for width in $MQAR_WIDTHS; do
    launch mqar_$width $((MQAR_JOB_S + GRACE_S)) $PY experiments/mqar.py $MQAR_ARGS --widths="$width" \
      --time_budget_s="$MQAR_JOB_S" --out="$RES/parts/mqar_d$width.json" --plot=
  done
  wait
}

lm_job() {
  # The LM comparison gets what is left until TOTAL_S, less its start-up and the final summary.
  local left lm_root
  left=$(( TOTAL_S - $(now) - 40 ))
  if [ "$LM" = 0 ] || [ "$left" -lt "$LM_MIN_S" ]; then
    echo "LM comparison skipped (LM=$LM, ${left} s left, needs $LM_MIN_S)" | tee "$OUT/lm.log"
    return
  fi
  lm_root=$(mktemp -d /tmp/lm_compare_runs.XXXXXX)
  echo "[$(now) s] LM comparison with a budget of ${left} s"
  job lm $((left + 30)) $PY experiments/lm_compare.py $LM_ARGS --time_budget_s="$left" --run_root="$lm_root" \
    --out="$RES/lm_compare.json" --plot="$RES/lm_compare.png"
  rm -rf "$lm_root"
}

if [ "$SERIAL" = 1 ]; then
  state_tracking_jobs; mqar_jobs; lm_job
else
  # The LM comparison follows the state-tracking jobs (the shorter ones) while the MQAR jobs run.
  { state_tracking_jobs; lm_job; } &
  mqar_jobs &
  wait
fi
echo "[$(now) s] all jobs done"
for rc in "$OUT"/*.rc; do
  name=$(basename "$rc" .rc)
  [ "$(cut -d' ' -f1 "$rc")" = 0 ] || { echo "== $name failed, last lines of $name.log:"; grep -v -i warning \
    "$OUT/$name.log" | tail -8; }
done

# Merge the per-process records, plot, and print the summary.
$PY - "$RES" "$OUT" <<'PY' | tee "$OUT/summary.txt"
import glob, json, math, os, sys
res, out = sys.argv[1], sys.argv[2]

def merge(pattern, path):
    parts = sorted(glob.glob(os.path.join(res, "parts", pattern)))
    records = [json.load(open(p)) for p in parts]
    if not records:
        return None
    merged = {k: v for k, v in records[0].items() if k not in ("runs", "settings", "seconds", "complete")}
    merged.update(parts=[dict(file=os.path.basename(p), settings=r["settings"], seconds=r["seconds"],
                              complete=r.get("complete", True)) for p, r in zip(parts, records)],
                  runs=[run for r in records for run in r["runs"]])
    json.dump(merged, open(path, "w"), indent=1)
    return merged

print("jobs (exit status, wall seconds):",
      ", ".join(f"{os.path.basename(p)[:-3]} {open(p).read().split()[0]} {open(p).read().split()[1]} s"
                for p in sorted(glob.glob(os.path.join(out, "*.rc")))))
st = merge("state_tracking_*.json", os.path.join(res, "state_tracking.json"))
if st:
    print(f"\nstate tracking ({st['device']}; steps: done / at most; cut = stopped at the deadline; s/step "
          f"includes compiling)")
    short, long = ("-".join(map(str, st["runs"][0]["lengths"][k])) for k in ("train", "test"))
    print(f"{'task':8} {'model':20} {'steps':>11} {'s/step':>7} {'impl':>7} {'loss':>6} {'acc ' + short:>10} "
          f"{'acc ' + long:>10} {'scaled':>7} {'scaled':>7}")
    for r in st["runs"]:
        per = r["train_seconds"] / max(r["steps"], 1)
        print(f"{r['task']:8} {r['variant']:20} {r['steps']:>5}/{r['max_steps']:<5} {per:7.4f} {r['rule_impl']:>7} "
              f"{r['final_loss']:6.3f} {r['accuracy']['train']:10.3f} {r['accuracy']['test']:10.3f} "
              f"{r['scaled_accuracy']['train']:7.2f} {r['scaled_accuracy']['test']:7.2f}"
              + (" cut" if r["stopped_early"] else ""))
else:
    print("\nstate tracking: no results")
mq = merge("mqar_*.json", os.path.join(res, "mqar.json"))
if mq:
    print(f"\nMQAR recall accuracy (steps done, impl)")
    widths = sorted({r["d_model"] for r in mq["runs"]})
    print(f"{'model':18}" + "".join(f"{'d=' + str(w):>26}" for w in widths))
    for v in dict.fromkeys(r["variant"] for r in mq["runs"]):
        cells = []
        for w in widths:
            r = next((r for r in mq["runs"] if r["variant"] == v and r["d_model"] == w), None)
            cells.append("-" if r is None else f"{r['accuracy']['test']:.3f} ({r['steps']}{' cut' if r['stopped_early'] else ''}, {r['rule_impl']})")
        print(f"{v:18}" + "".join(f"{c:>26}" for c in cells))
else:
    print("\nMQAR: no results")
path = os.path.join(res, "lm_compare.json")
if os.path.exists(path):
    lm = json.load(open(path))
    print(f"\nLM comparison ({lm['corpus']})")
    print(f"{'model':22} {'params':>9} {'steps':>6} {'tokens':>11} {'val loss @1x':>12} {'@2x':>7} {'seconds':>7}")
    for r in lm["runs"]:
        s = r["summary"]
        print(f"{r['variant']:22} {r['parameters']:9,} {s['step']:6} {r['tokens']:11,} {s.get('eval_loss@1x', math.nan):12.4f} "
              f"{s.get('eval_loss@2x', math.nan):7.4f} {r['seconds']:7.0f}" + (" cut" if s.get("stopped_early") else ""))
    if not lm.get("complete", True):
        print("(incomplete: the job was cut before its last variant)")
else:
    print("\nLM comparison: not run")
PY
# Plots of the merged records (the LM job plots its own).
[ -f "$RES/state_tracking.json" ] && $PY experiments/state_tracking.py --tabulate="$RES/state_tracking.json" \
  --plot="$RES/state_tracking.png" >"$OUT/plot_st.log" 2>&1 &
[ -f "$RES/mqar.json" ] && $PY experiments/mqar.py --tabulate="$RES/mqar.json" --plot="$RES/mqar.png" \
  >"$OUT/plot_mqar.log" 2>&1 &
wait
ls "$RES"
echo "[$(now) s] finished"
