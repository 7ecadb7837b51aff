#!/usr/bin/env bash
# Device calls (one H100, at most 10 minutes each): the research reproductions of docs/results.md sections 1-3 at
# GPU scale, inside a total wall budget (default 540 s, install, compilation and the summary included).
#
#   bash tools/fetch_gpu_wheels.sh                 # once, here: grain's wheels into .whl/ (carried)
#   OUT=$OUT MQAR=0 LM=0 bash experiments/gpu_reproduce.sh   # on the device, one part per call (ST, MQAR, LM:
#                                                           # 21 runs at once do not fit one GPU); results in
#                                                           # $OUT/results, logs in $OUT
#   SCALE=smoke OUT=/tmp/repro PYTHON=.venv/bin/python bash experiments/gpu_reproduce.sh   # CPU check, minutes
#
# One process per run (variant x width), all started together on the one GPU, so that no run waits for another's
# compilation (the 2026-11-23 run shared processes and lost whole runs to it, docs/results.md). Every run uses
# the XLA chunked form (--impl=chunk; recorded per run as rule_impl): the Pallas kernels compile for minutes
# through Triton at these small shapes. Jobs:
#   state tracking  parity (ST_TASKS="modular modular_brackets": the arithmetic tasks), DeltaNet / Gated DeltaNet
#                   with beta in [0, 1] and [0, 2]; 2 layers, d_model 128, train length 40 (scored 3-40), test
#                   40-256; batch 256, at most 5000 steps; float32.
#   MQAR            test at Zoology's hard setting (vocabulary 8192, sequence 512, 64 key-value pairs), trained
#                   on Zoology's mixture of easier settings (64:4, 128:8, 256:16, 256:32, 256:64, padded to 256;
#                   deltajax.data.MQARMixture); 2 layers; Gated DeltaNet, DeltaNet, linear attention, KDA at
#                   d_model 64, 128, 256; batch 128, at most 4000 steps, AdamW 1e-3; bfloat16 compute.
#   LM              byte-level LM on the Python stdlib, 5 step-size variants, d_model 256, 4 layers, 2 heads of
#                   128, length 512, batch 32, 400 steps (equal tokens), bfloat16; the trainer's budget guards it.
# Budgets: after the install every job gets JOB_S = TOTAL_S - elapsed - FINAL_S - GRACE_S seconds as its hard
# --time_budget_s (compilation and evaluation included) and runs under `timeout JOB_S + GRACE_S`. The synthetic
# runs compile their evaluation first and train for TRAIN_S = JOB_S - COMPILE_S seconds counted from the end of
# their first (compiling) step (--train_seconds, experiments/_synthetic.py), so every run trains for the same wall
# time whatever its compilation took, and a compilation longer than COMPILE_S only shortens that run. Each run
# fits its learning-rate schedule to the steps that fit. JSON records are written per process and merged at the
# end. Environment overrides: SCALE (gpu | smoke), OUT, PYTHON, TOTAL_S, FINAL_S, GRACE_S, COMPILE_S, JOB_S,
# TRAIN_S, SERIAL (1: one job at a time, each with an equal part of the time; set by itself when the GPU is in an
# exclusive compute mode), ST, MQAR, LM (0: skip that part, e.g. MQAR alone in a second call: ST=0 LM=0), and the
# argument strings ST_ARGS, ST_TASKS, ST_VARIANTS, MQAR_ARGS, MQAR_VARIANTS, MQAR_WIDTHS, LM_ARGS, LM_VARIANTS.
set -u -o pipefail
T0=$(date +%s)
OUT=${OUT:-gpu_logs}
RES="$OUT/results"
mkdir -p "$RES/parts"
PY=${PYTHON:-python3}
SCALE=${SCALE:-gpu}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false TF_CPP_MIN_LOG_LEVEL=2
# The second H100 attempt (2026-11-23 15:57) spent 2.3-2.5 minutes per XLA module autotuning GEMM fusions with 21
# processes sharing 16 cores: autotuning off by default here (AUTOTUNE=1 keeps XLA's default).
[ "${AUTOTUNE:-0}" = 1 ] || export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0"
now() { echo $(( $(date +%s) - T0 )); }

case $SCALE in
  gpu)
    TOTAL_S=${TOTAL_S:-540}; FINAL_S=${FINAL_S:-30}; GRACE_S=${GRACE_S:-20}; COMPILE_S=${COMPILE_S:-150}
    ST_ARGS=${ST_ARGS:-"--d_model=128 --n_layers=2 --train_len=40 --min_len=3 --test_len=256
      --steps=5000 --batch_size=256 --learning_rate=3e-3 --eval_batches=4 --compute_dtype=float32 --impl=chunk
      --data_workers=1"}
    MQAR_ARGS=${MQAR_ARGS:-"--vocab_size=8192 --seq_len=512 --num_kv_pairs=64
      --train_mixture=64:4,128:8,256:16,256:32,256:64 --n_layers=2 --steps=4000 --batch_size=128
      --learning_rate=1e-3 --eval_batches=4 --compute_dtype=bfloat16 --impl=chunk --data_workers=1"}
    MQAR_VARIANTS=${MQAR_VARIANTS:-"gated_deltanet deltanet linear_attention kda"}
    MQAR_WIDTHS=${MQAR_WIDTHS:-"64 128 256"}
    LM_ARGS=${LM_ARGS:-"--d_model=256 --n_layers=4 --n_heads=2 --seq_len=512 --batch_size=32 --steps=400
      --learning_rate=1e-3 --eval_every=200 --eval_batches=4 --compute_dtype=bfloat16 --impl=chunk"}
    LM_VARIANTS=${LM_VARIANTS:-"gated_deltanet deltanet gdn_relaxed_kaczmarz gdn_longhorn gdn_efla"}
    ;;
  smoke)
    TOTAL_S=${TOTAL_S:-300}; FINAL_S=${FINAL_S:-40}; GRACE_S=${GRACE_S:-30}; COMPILE_S=${COMPILE_S:-120}
    ST_ARGS=${ST_ARGS:-"--d_model=16 --train_len=16 --min_len=3 --test_len=32 --steps=300
      --batch_size=8 --eval_batches=1 --data_workers=0"}
    MQAR_ARGS=${MQAR_ARGS:-"--vocab_size=64 --seq_len=32 --num_kv_pairs=4 --train_mixture=16:2,32:4 --steps=300
      --batch_size=8 --eval_batches=1 --data_workers=0"}
    MQAR_VARIANTS=${MQAR_VARIANTS:-"gated_deltanet"}
    MQAR_WIDTHS=${MQAR_WIDTHS:-"16 32"}
    LM_ARGS=${LM_ARGS:-"--d_model=16 --n_layers=1 --seq_len=32 --batch_size=4 --steps=40 --eval_every=0
      --eval_batches=1"}
    LM_VARIANTS=${LM_VARIANTS:-"gated_deltanet gdn_longhorn"}
    ;;
  *) echo "SCALE must be gpu or smoke, got $SCALE"; exit 2 ;;
esac
ST_VARIANTS=${ST_VARIANTS:-"deltanet deltanet_neg gated_deltanet gated_deltanet_neg"}
ST_TASKS=${ST_TASKS:-parity}  # one process per task and variant, e.g. ST_TASKS="modular modular_brackets"
ST=${ST:-1}
MQAR=${MQAR:-1}
LM=${LM:-1}
[ "$ST" != 0 ] || ST_VARIANTS=""
[ "$MQAR" != 0 ] || MQAR_WIDTHS=""

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
jobs=$(( $(echo $ST_VARIANTS | wc -w) * $(echo $ST_TASKS | wc -w) + $(echo $MQAR_VARIANTS | wc -w) * $(echo $MQAR_WIDTHS | wc -w) ))
[ "$LM" = 0 ] || jobs=$(( jobs + $(echo $LM_VARIANTS | wc -w) ))
if [ "$jobs" = 0 ]; then echo "nothing to run: ST, MQAR and LM are all 0"; exit 2; fi
# Each concurrent process gets an equal share of the GPU's memory, so that one cannot starve the others (the same
# attempt lost 7 of 21 runs to out-of-memory errors). More than MAX_JOBS concurrent runs is refused: split the
# parts over calls with the ST/MQAR/LM toggles (e.g. MQAR=0 LM=0, then ST=0 LM=0, then ST=0 MQAR=0).
MAX_JOBS=${MAX_JOBS:-12}
if [ "$SERIAL" != 1 ] && [ "$jobs" -gt "$MAX_JOBS" ]; then
  echo "$jobs concurrent runs would share one GPU (more than MAX_JOBS=$MAX_JOBS): split them with ST/MQAR/LM"; exit 2
fi
[ "$SERIAL" = 1 ] || export XLA_PYTHON_CLIENT_MEM_FRACTION=${MEM_FRACTION:-$(awk "BEGIN { printf \"%.3f\", 0.9 / $jobs }")}
# What is left for the jobs: in parallel each job gets all of it, in sequence an equal part.
left=$(( TOTAL_S - $(now) - FINAL_S - GRACE_S ))
if [ "$SERIAL" = 1 ]; then left=$(( (TOTAL_S - $(now) - FINAL_S) / jobs - GRACE_S )); fi
JOB_S=${JOB_S:-$left}
TRAIN_S=${TRAIN_S:-$(( JOB_S - COMPILE_S ))}
if [ "$TRAIN_S" -lt $(( JOB_S / 4 )) ]; then TRAIN_S=$(( JOB_S / 4 )); fi  # compilation allowance never all of it
echo "[$(now) s] installed; scale $SCALE, serial $SERIAL; $jobs jobs of ${JOB_S} s each (training ${TRAIN_S} s" \
  "after compiling), total budget ${TOTAL_S} s"
if [ "$JOB_S" -lt 10 ]; then echo "no time left for the jobs (JOB_S=$JOB_S)"; exit 1; fi

# job NAME CMD...: runs CMD under timeout, output to $OUT/NAME.log; exit status and seconds to NAME.rc.
job() {
  local name=$1 start; shift
  start=$(date +%s)
  timeout -k 10 $((JOB_S + GRACE_S)) "$@" >"$OUT/$name.log" 2>&1
  echo "$? $(( $(date +%s) - start ))" >"$OUT/$name.rc"
  echo "[$(now) s] $name done (exit $(cut -d' ' -f1 "$OUT/$name.rc"), $(cut -d' ' -f2 "$OUT/$name.rc") s)"
}
launch() { if [ "$SERIAL" = 1 ]; then job "$@"; else job "$@" & fi; }

for task in $ST_TASKS; do
  for variant in $ST_VARIANTS; do
    launch st_${task}_$variant $PY experiments/state_tracking.py $ST_ARGS --tasks="$task" --variants="$variant" \
      --time_budget_s="$JOB_S" --train_seconds="$TRAIN_S" --out="$RES/parts/state_tracking_${task}_$variant.json" --plot=
  done
done
for width in $MQAR_WIDTHS; do
  for variant in $MQAR_VARIANTS; do
    launch mqar_${variant}_$width $PY experiments/mqar.py $MQAR_ARGS --variants="$variant" --widths="$width" \
      --time_budget_s="$JOB_S" --train_seconds="$TRAIN_S" --out="$RES/parts/mqar_${variant}_d$width.json" --plot=
  done
done
if [ "$LM" != 0 ]; then
  lm_root=$(mktemp -d /tmp/lm_compare_runs.XXXXXX)
  for variant in $LM_VARIANTS; do
    # The trainer's budget counts from its call (compilation included); keep room for its final evaluation.
    launch lm_$variant $PY experiments/lm_compare.py $LM_ARGS --variants="$variant" --time_budget_s="$JOB_S" \
      --run_root="$lm_root" --out="$RES/parts/lm_compare_$variant.json" --plot=
  done
fi
wait
[ "$LM" = 0 ] || rm -rf "$lm_root"
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
    print(f"\nstate tracking ({st['device']}; steps: done / at most; cut = stopped at the deadline; compile: "
          f"seconds of the first step; s/step after it)")
    short, long = ("-".join(map(str, st["runs"][0]["lengths"][k])) for k in ("train", "test"))
    print(f"{'task':8} {'model':20} {'steps':>11} {'compile':>7} {'s/step':>7} {'impl':>7} {'loss':>6} "
          f"{'acc ' + short:>10} {'acc ' + long:>10} {'scaled':>7} {'scaled':>7}")
    for r in st["runs"]:
        first = r.get("first_step_seconds") or 0.0
        per = (r["train_seconds"] - first) / max(r["steps"] - 1, 1)
        print(f"{r['task']:8} {r['variant']:20} {r['steps']:>5}/{r['max_steps']:<5} {first:7.1f} {per:7.4f} "
              f"{r['rule_impl']:>7} "
              f"{r['final_loss']:6.3f} {r['accuracy']['train']:10.3f} {r['accuracy']['test']:10.3f} "
              f"{r['scaled_accuracy']['train']:7.2f} {r['scaled_accuracy']['test']:7.2f}"
              + (" cut" if r["stopped_early"] else ""))
else:
    print("\nstate tracking: no results")
mq = merge("mqar_*.json", os.path.join(res, "mqar.json"))
if mq:
    test = mq["parts"][0]["settings"]
    print(f"\nMQAR recall accuracy (steps done, impl); trained on {mq['runs'][0].get('train_data', '?')}, tested "
          f"at {test['seq_len']} tokens, {test['num_kv_pairs']} pairs")
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
lm = merge("lm_compare_*.json", os.path.join(res, "lm_compare.json"))
if lm:
    print(f"\nLM comparison ({lm['corpus']})")
    print(f"{'model':22} {'params':>9} {'steps':>6} {'tokens':>11} {'val loss @1x':>12} {'@2x':>7} {'seconds':>7}")
    for r in lm["runs"]:
        s = r["summary"]
        print(f"{r['variant']:22} {r['parameters']:9,} {s['step']:6} {r['tokens']:11,} {s.get('eval_loss@1x', math.nan):12.4f} "
              f"{s.get('eval_loss@2x', math.nan):7.4f} {r['seconds']:7.0f}" + (" cut" if s.get("stopped_early") else ""))
    if not all(part["complete"] for part in lm["parts"]):
        print("(incomplete: a job was cut before it wrote its final record)")
else:
    print("\nLM comparison: not run")
PY
# Plots of the merged records.
[ -f "$RES/state_tracking.json" ] && $PY experiments/state_tracking.py --tabulate="$RES/state_tracking.json" \
  --plot="$RES/state_tracking.png" >"$OUT/plot_st.log" 2>&1 &
[ -f "$RES/mqar.json" ] && $PY experiments/mqar.py --tabulate="$RES/mqar.json" --plot="$RES/mqar.png" \
  >"$OUT/plot_mqar.log" 2>&1 &
[ -f "$RES/lm_compare.json" ] && $PY experiments/lm_compare.py --tabulate="$RES/lm_compare.json" \
  --plot="$RES/lm_compare.png" >"$OUT/plot_lm.log" 2>&1 &
wait
ls "$RES"
echo "[$(now) s] finished"
