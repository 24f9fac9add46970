#!/usr/bin/env bash
# The GPU benchmarks in one run on one NVIDIA GPU, meant to finish within
# 5 to 6 minutes on an H200, each part checked against its reference before
# it is timed:
#   1. gpu_steps.py --check: the sparse update for SGD, row-wise AdaGrad and
#      LazyAdam (sorted XLA ops, the fused Mosaic GPU kernel, the old XLA
#      ops; GB/s, %-of-copy and the >= 40% target), a sparse train step and
#      a DLRM step (kernel="auto", kernel="pallas" with the fused update,
#      the XLA ops), each against its XLA-op version;
#   2. pipeline_step.py --check: the quickstart DLRM's pipelined train step
#      (and its early fetch) against the in-line step, checked bit for bit
#      first, if time is left (not under --smoke);
#   3. gpu_lookup.py --check: every kernel (Mosaic GPU, Triton) and gradient
#      against its reference, then gather / bag GB/s and %-of-copy for Mosaic
#      GPU, Triton and XLA side by side, and the backward's reduction;
#      and the targets (gather >= 80% of copy, bag >= 2x XLA) with the shapes
#      where XLA is faster, as far as time allows;
#   4. sparse_step.py --check --quick --no-peers: the sparse step against the
#      dense optax step, if time is left.
#
#   bash benchmarks/gpu_session.sh            # output also in $OUT/gpu_session.txt when $OUT is set,
#                                             # each script's --json record in $OUT/<script>.json
#   bash benchmarks/gpu_session.sh --smoke    # any backend, tiny sizes: tests the script itself
#
# Without a GPU (and without --smoke) it says so and exits 0, having measured
# nothing. Exits 1 if a check fails (the timings after it are not run).
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
log=${OUT:+$OUT/gpu_session.txt}
log=${log:-/dev/null}
smoke=()
if [ "${1:-}" = "--smoke" ]; then
  smoke=(--smoke)
fi

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
run() {
  echo "== $* (at $((SECONDS - start)) s)" | tee -a "$log"
  local record=()
  if [ -n "${OUT:-}" ]; then
    record=(--json "$OUT/$(basename "$1" .py).json")
  fi
  "$python" "$@" "${record[@]}" 2>&1 | tee -a "$log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || exit 1
}
# The steps first: the first GPU run (benchmarks/README.md) measured the
# lookups whole and moved kernel="auto" to XLA's ops, so what the defaults
# now run (the train steps) comes before the kernels' tables. Each script
# stops starting cases past its budget; --smoke times every case.
budget() {
  local left=$(($1 - (SECONDS - start)))
  if [ ${#smoke[@]} -eq 0 ]; then
    echo --budget $((left > 30 ? left : 30))
  fi
}
run benchmarks/gpu_steps.py --check --repeats 5 --inner 10 $(budget 130) "${smoke[@]}"
if [ ${#smoke[@]} -eq 0 ]; then
  if [ $((SECONDS - start)) -lt 200 ]; then
    run benchmarks/pipeline_step.py --check --repeats 5
  else
    echo "gpu_session: pipeline_step.py not run (past 200 s)" | tee -a "$log"
  fi
fi
# The lookups' check always runs whole (every kernel against its reference);
# their timings get what is left of 300 s.
run benchmarks/gpu_lookup.py --check --repeats 5 --inner 20 $(budget 300) "${smoke[@]}"
if [ ${#smoke[@]} -eq 0 ]; then
  if [ $((SECONDS - start)) -lt 290 ]; then
    run benchmarks/sparse_step.py --check --quick --no-peers --repeats 5
  else
    echo "gpu_session: sparse_step.py not run (past 290 s)" | tee -a "$log"
  fi
fi
echo "gpu_session: done in $((SECONDS - start)) s" | tee -a "$log"
