#!/usr/bin/env bash
# The GPU benchmarks in one run on one NVIDIA GPU, meant to finish within
# 5 minutes on an H100 or H200, each part checked against its reference
# before it is timed:
#   1. gpu_sweep.py: every lookup kernel's variants (the Triton rows kernels'
#      tile shapes, rows or bags per program, unroll, warps; the Mosaic GPU
#      and first Triton kernels) beside XLA's ops and torch's embedding /
#      embedding_bag, at 1M x 128 and 10M x 64, float32, bfloat16, int8 and
#      int4 rows, uniform and Zipf ids: the gather, bags of 16 and 64, the
#      backward's reduction and the fused sparse update (SGD, row-wise
#      AdaGrad, LazyAdam); then the sparse train step and the quickstart
#      DLRM step (batch 65,536) with kernel="auto" (on the table this run
#      measured) against kernel="xla";
#   2. pipeline_step.py --check: the quickstart DLRM's pipelined step against
#      the in-line step, bit for bit first, if time is left (not under --smoke).
#
#   bash benchmarks/gpu_session.sh --confirm --json benchmarks/results/gpu_$(date +%F).json
#   bash benchmarks/gpu_session.sh --smoke --json /tmp/smoke.json   # any backend, tiny: tests the script
#
# --json FILE: the sweep's record (timing.Run), its cases with kernel, variant,
# shape, dtype, ids, median_us...; kept as benchmarks/results/gpu_<date>.json, it is what
# `python benchmarks/gpu_table.py` turns into kernel="auto"'s table.
# --confirm: then the lookups' sweep once more (compiles cached), into
# FILE's name with _confirm before .json: gpu_table.py reads a date's files
# together and picks a kernel only where it won in both runs. The whole
# stays under 9 minutes (the device tool's command limit is 10). The
# output is also in $OUT/gpu_session.txt when $OUT is set, and each other
# script's --json record in $OUT/<script>.json.
#
# Without a GPU (and without --smoke) it says so and exits 0, having measured
# nothing. Exits 1 if a check fails (the rest still runs: the failing
# variants are left out of the timings and marked in the JSON).
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
log=${OUT:+$OUT/gpu_session.txt}
log=${log:-/dev/null}
smoke=()
json=()
confirm=0
while [ $# -gt 0 ]; do
  case "$1" in
    --smoke) smoke=(--smoke) ;;
    --json) json=(--json "$2"); shift ;;
    --confirm) confirm=1 ;;
    *) echo "gpu_session: unknown argument '$1' (use --smoke, --json FILE, --confirm)"; exit 2 ;;
  esac
  shift
done
if [ $confirm -eq 1 ] && [ ${#json[@]} -eq 0 ]; then
  echo "gpu_session: --confirm needs --json FILE (the rerun writes FILE's name with _confirm)"
  exit 2
fi
# One compilation cache for both sweeps: the rerun spends its time timing.
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-${TMPDIR:-/tmp}/embedlib-gpu-session-cache}

backend=$("$python" -c 'import jax; print(jax.default_backend())' 2>/dev/null)
if [ "$backend" != "gpu" ] && [ ${#smoke[@]} -eq 0 ]; then
  echo "gpu_session: jax's default backend is '${backend:-unavailable}', not a GPU; nothing measured." | tee "$log"
  exit 0
fi
: > "$log"
start=$SECONDS
if [ "$backend" = "gpu" ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$log"
fi
status=0
run() {
  echo "== $* (at $((SECONDS - start)) s)" | tee -a "$log"
  # Each script's --json record: the one asked for, else $OUT/<script>.json when $OUT is set.
  local record=()
  if [ -n "${OUT:-}" ] && [[ " $* " != *" --json "* ]]; then
    record=(--json "$OUT/$(basename "$1" .py).json")
  fi
  "$python" "$@" "${record[@]}" 2>&1 | tee -a "$log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
}
# The lookups get 210 s (no new group starts after that); the two steps
# follow whatever the lookups took. --smoke runs every case.
budget=()
if [ ${#smoke[@]} -eq 0 ]; then
  budget=(--budget 210)
fi
run benchmarks/gpu_sweep.py --repeats 5 --inner 20 "${budget[@]}" "${json[@]}" "${smoke[@]}"
if [ ${#smoke[@]} -eq 0 ]; then
  if [ $((SECONDS - start)) -lt 270 ]; then
    run benchmarks/pipeline_step.py --check --repeats 5
  else
    echo "gpu_session: pipeline_step.py not run (past 270 s)" | tee -a "$log"
  fi
fi
if [ $confirm -eq 1 ]; then
  # The rerun's lookups stop starting groups by 480 s; its steps are not rerun.
  left=$((480 - (SECONDS - start)))
  again=(--budget $((left > 30 ? left : 30)))
  [ ${#smoke[@]} -eq 0 ] || again=(--smoke)
  run benchmarks/gpu_sweep.py --repeats 5 --inner 20 --no-steps "${again[@]}" \
    --json "${json[1]%.json}_confirm.json"
fi
echo "gpu_session: done in $((SECONDS - start)) s" | tee -a "$log"
exit $status
