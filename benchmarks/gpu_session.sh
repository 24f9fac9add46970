#!/usr/bin/env bash
# The GPU benchmarks in one run on one NVIDIA GPU: the lookup kernels
# (gpu_lookup.py), then the sparse train step (sparse_step.py), each checked
# against its reference before it is timed.
#
#   bash benchmarks/gpu_session.sh              # output also in $OUT/gpu_session.txt when $OUT is set
#
# Without a GPU it says so and exits 0, having measured nothing. Exits 1 if a
# check fails (the timings after it are not run).
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
log=${OUT:+$OUT/gpu_session.txt}
log=${log:-/dev/null}

backend=$("$python" -c 'import jax; print(jax.default_backend())' 2>/dev/null)
if [ "$backend" != "gpu" ]; then
  echo "gpu_session: jax's default backend is '${backend:-unavailable}', not a GPU; nothing measured." | tee "$log"
  exit 0
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee "$log"
"$python" benchmarks/gpu_lookup.py --check 2>&1 | tee -a "$log"
[ "${PIPESTATUS[0]}" -eq 0 ] || exit 1
"$python" benchmarks/sparse_step.py --check --no-peers 2>&1 | tee -a "$log"
[ "${PIPESTATUS[0]}" -eq 0 ] || exit 1
