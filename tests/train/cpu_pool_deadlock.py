"""The raw-id run's deadlock reduced to its train step, with jax 0.10's pool or embedlib's.

``smoke_raw``'s train step (26 dynamic tables, each lookup a ``lax.cond`` of
``all_to_all`` s, beside the dense part's ``all_gather`` s) called in a loop
on 8 simulated devices, on 8 batches of synthetic Criteo lines: none of the
trainer (no prefetch thread, eval, checkpoint or progress line). The pool
is what ``PJRT_NPROC`` says when the backend starts; ``import embedlib``
leaves a value already there alone, so

    PJRT_NPROC=8 python tests/train/cpu_pool_deadlock.py  # jax 0.10's: max(cores, devices)
    python tests/train/cpu_pool_deadlock.py               # embedlib's: 8 threads a device

compare the pool jax 0.10 gives 8 devices on a 2-core machine with the one
embedlib sets. Where the pool is too small a step never ends: XLA:CPU
prints "may be stuck" for a collective some device never reached and
aborts the process (status 134) at its terminate timeout. Pass
``XLA_FLAGS=--xla_cpu_collective_call_terminate_timeout_seconds=15`` (and
the ``warn`` one) to get there sooner, and run it under ``timeout``.
``embedlib/cpu_pool.py`` says why; the figures are in benchmarks/README.md.

Pure-jax programs of conds holding collectives beside an independent
``all_gather`` did not stop in tries on jax 0.10: the step's own mix of
work is kept here.
"""

import argparse
import itertools
import os
import sys
import tempfile
import time

# The repository root, for configs/ and train/.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=60)
  parser.add_argument("--devices", type=int, default=8)
  args = parser.parse_args()
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={args.devices}")
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import embedlib  # pylint: disable=g-import-not-at-top,unused-import  (sizes the pool: cpu_pool)
  import jax  # pylint: disable=g-import-not-at-top
  from configs import dlrm_criteo  # pylint: disable=g-import-not-at-top
  from embedlib import cpu_pool  # pylint: disable=g-import-not-at-top
  from embedlib import data as data_lib  # pylint: disable=g-import-not-at-top
  from embedlib.data.criteo_synth import CriteoSynth  # pylint: disable=g-import-not-at-top
  from embedlib.training import setup, steps  # pylint: disable=g-import-not-at-top

  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "day.tsv")
    CriteoSynth().write(path, 2000)
    config = dlrm_criteo.get_config("smoke_raw")
    with config.unlocked():
      config.data.train_path, config.data.eval_holdout = path, 0.05
    task = setup.task(config)
    mesh = setup.make_mesh(config)
    spec = task.data_spec()
    source, _ = setup.sources(config, task, spec)
    model, optimizer = setup.model_and_optimizer(config, task, spec, mesh)
    batches = [data_lib.to_global_batch(task.featurize(b), mesh)
               for b in itertools.islice(source, 8)]
  print(f"jax {jax.__version__}, {jax.device_count()} devices, PJRT_NPROC="
        f"{os.environ.get('PJRT_NPROC')}, {cpu_pool.pool_threads()} {cpu_pool.THREAD_NAME} "
        "threads", flush=True)
  start = time.perf_counter()
  for i in range(args.steps):
    loss = jax.block_until_ready(steps.train_step(model, optimizer, batches[i % 8], task=task))
    if i == 0 or (i + 1) % 10 == 0:
      print(f"step {i + 1} done, loss {float(loss):.4f} ({time.perf_counter() - start:.0f} s)",
            flush=True)
  print(f"done: {args.steps} steps", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
