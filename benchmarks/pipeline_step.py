"""The quickstart DLRM's train step in line against the pipelined step, on this machine's devices.

    python benchmarks/pipeline_step.py --check            # on a GPU (gpu_session.sh runs it)
    python benchmarks/pipeline_step.py --check --smoke    # any backend, tiny: tests the script
    python benchmarks/pipeline_step.py --check --json run.json  # also the run's record (timing.Run)

``--check`` first trains a few steps both ways from the same start and
requires the losses to be equal bit for bit; then both steps are timed,
interleaved (``timing.interleaved``): the pipelined step
(``embedlib.training.pipelined_train_step``, with ``--early-fetch`` the
early-fetch mode too) distributes the next batch's ids inside each step. On
one device nothing is distributed and the figure is the pipeline's overhead;
the overlap it buys needs several. ``--json FILE`` keeps the run's record
(``benchmarks/timing.py``): the cases and the named ratios
``pipelined_over_in_line`` and ``early_fetch_over_in_line`` (medians),
beside the machine's state. A sample is ``--inner`` calls back to back
(default 8; 1 before 2026-12-07's eighth session), in ms a call: on CPU one
call timed alone pays the machine's wake-up (``benchmarks/README.md``, "One
step timed alone").
"""

from __future__ import annotations

import argparse
import pathlib
import sys

if __name__ == "__main__":
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax

from benchmarks import timing
from configs import quickstart
from embedlib import data as data_lib
from embedlib.training import pipeline, setup, steps


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=65536)
  parser.add_argument("--repeats", type=int, default=10)
  parser.add_argument("--early-fetch", type=float, default=0.25)
  parser.add_argument("--check", action="store_true")
  parser.add_argument("--smoke", action="store_true", help="tiny sizes, 2 repeats")
  timing.add_inner_argument(parser, since="2026-12-07's eighth session")
  timing.add_json_argument(parser)
  args = parser.parse_args(argv)
  timing.check_inner(parser, args.inner)
  record = timing.Run("pipeline_step", argv, smoke=args.smoke)
  config = quickstart.get_config("smoke" if args.smoke else None)
  config.batch_size = 64 if args.smoke else args.batch
  repeats = 2 if args.smoke else args.repeats
  mesh = setup.make_mesh(config)
  task = setup.task(config)
  spec = task.data_spec()
  source = data_lib.SyntheticSource(spec, batch_size=config.batch_size)
  batches = [data_lib.to_global_batch(next(source), mesh) for _ in range(4)]
  print(f"quickstart DLRM, batch {config.batch_size}, {jax.device_count()} x "
        f"{jax.devices()[0].device_kind}")

  def built():
    return setup.model_and_optimizer(config, task, spec, mesh)

  if args.check:
    want = [float(steps.train_step(*pair, b, task=task)) for pair in [built()] for b in batches[:3]]
    for early in (0.0, args.early_fetch):
      model, optimizer = built()
      distributed = pipeline.distribute_batch(model, batches[0], task=task, early_fetch=early)
      got = []
      for i in range(3):
        loss, distributed = pipeline.pipelined_train_step(
            model, optimizer, batches[i], distributed, batches[i + 1], task=task,
            early_fetch=early)
        got.append(float(loss))
      if got != want:
        print(f"pipeline_step: early_fetch={early}: losses {got} differ from in line {want}")
        return 1
    print("check: the pipelined step (and early fetch) trains as in line, bit for bit")

  in_line = built()
  cases = {"in line": (lambda: steps.train_step(*in_line, batches[0], task=task), ())}
  for name, early in (("pipelined", 0.0), (f"pipelined, early fetch {args.early_fetch}",
                                            args.early_fetch)):
    model, optimizer = built()
    carried = [pipeline.distribute_batch(model, batches[0], task=task, early_fetch=early)]

    def step(model=model, optimizer=optimizer, carried=carried, early=early):
      loss, carried[0] = pipeline.pipelined_train_step(
          model, optimizer, batches[0], carried[0], batches[1], task=task, early_fetch=early)
      return loss

    cases[name] = (step, ())
  times = timing.interleaved(cases, repeats, between_rounds=record.probe, calls=args.inner)
  timing.print_table(times, "in line", "train step, ms (min / median / max)")
  record.add_times(times)
  names = list(times)
  record.ratio("pipelined_over_in_line", timing.median_ratio(times[names[1]], times[names[0]]))
  record.ratio("early_fetch_over_in_line", timing.median_ratio(times[names[2]], times[names[0]]))
  record.finish(args.json)
  return 0


if __name__ == "__main__":
  sys.exit(main())
