"""Criteo input: TSV lines/s by number of worker processes, and the binary format's examples/s.

    python benchmarks/input_pipeline.py                    # 100,352 lines; workers 0, 1, 2
    python benchmarks/input_pipeline.py --workers 0,1,2,4  # more worker counts
    python benchmarks/input_pipeline.py --quick            # a smoke run
    python benchmarks/input_pipeline.py --json run.json    # also the run's record (timing.Run)

One ``criteo_synth`` file (its lines have the real files' layout and empty
fields), converted once to the binary format (``embedlib.data.criteo_binary``,
hashed ids). Every case is an endless reader of the same file at the same
batch size, started before the timing (worker start-up is printed apart);
then every case reads ``--window`` examples per repeat, round-robin over the
cases, ``--repeats`` times. Before each timed window a case first reads the
batches its workers parsed ahead while the other cases ran (about 4 chunks
of ``CHUNK_LINES`` per worker), so that a window times parsing, not a full
buffer.

- ``tsv, in-process``: ``CriteoReader(workers=0)``, the parse in this process;
- ``tsv, N workers``: ``CriteoReader(workers=N)``, chunks parsed in N grain
  worker processes and cut into batches here;
- ``binary``: ``CriteoBinaryReader``, batches sliced from the memory-mapped
  records (at the TSV's batch size, and at ``--big-batch``).

Prints examples/s (min / median / max over the repeats) and the ratio of
medians to the in-process TSV reader, and the CPU time each case spends per
1,000 examples (median): in this process, and in this one and the case's
own workers. After each window the run waits ``--settle`` seconds, so that
the workers refilling their buffers don't run in the next case's window. On a shared machine the wall-clock rates depend on what
else runs; the CPU times show what the cases cost wherever they run: with
W workers on W free cores the rate is bound by the busiest process.
``--json FILE`` keeps the run's record (``benchmarks/timing.py``): each
case's examples/s, and its ratio of medians to the in-process reader as
``<case>_over_in_process`` (``tsv_2_workers_over_in_process``,
``binary_batch_2048_over_in_process``), beside the machine's state (a copy
probe after each round). Never asserts a time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import psutil  # installed with grain

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))

from embedlib.data import criteo_binary, criteo_chunks, criteo_spec  # noqa: E402
from embedlib.data.criteo import CriteoReader  # noqa: E402
from embedlib.data.criteo_synth import CriteoSynth  # noqa: E402
import timing  # noqa: E402


def _read(reader, examples: int, batch_size: int) -> None:
  for _ in range(-(-examples // batch_size)):
    next(reader)


def _cpu(processes) -> float:
  """CPU seconds of ``processes`` (this one and a case's workers)."""
  total = 0.0
  for process in processes:
    try:
      total += sum(process.cpu_times()[:2])
    except psutil.NoSuchProcess:
      pass
  return total


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--lines", type=int, default=100_352)
  parser.add_argument("--workers", default="0,1,2", help="comma-separated worker counts")
  parser.add_argument("--batch-size", type=int, default=2048)
  parser.add_argument("--big-batch", type=int, default=65_536)
  parser.add_argument("--window", type=int, default=49_152, help="TSV examples per repeat")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--settle", type=float, default=0.5,
                      help="seconds between windows, for the last case's workers to refill")
  parser.add_argument("--quick", action="store_true")
  timing.add_json_argument(parser)
  args = parser.parse_args(argv)
  record = timing.Run("input_pipeline", argv, smoke=args.quick)
  if args.quick:
    # A smoke run: windows this short are within reach of the buffers' noise.
    args.lines, args.window, args.repeats, args.big_batch = 30_000, 16_384, 2, 8_192
  counts = [int(w) for w in args.workers.split(",")]
  tables = [1_000_000] * 26
  spec = criteo_spec(tables)
  batch = args.batch_size

  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "day.tsv")
    CriteoSynth().write(path, args.lines)
    size = os.path.getsize(path)
    tic = time.perf_counter()
    criteo_binary.convert([path], os.path.join(tmp, "bin"), table_sizes=tables,
                          workers=max(counts))
    print(f"file: {args.lines:,} lines, {size / 2**20:.1f} MiB; binary written in "
          f"{time.perf_counter() - tic:.1f} s with {max(counts)} workers; batch {batch}; "
          f"cpus: {os.cpu_count()}")

    me = psutil.Process()
    cases = {}  # name -> (reader, examples per window, batch size, examples to read first)
    processes = {}  # name -> this process and the case's workers
    for w in counts:
      tic = time.perf_counter()
      before = {p.pid for p in me.children(recursive=True)}
      reader = CriteoReader(path, spec, batch_size=batch, num_epochs=None, workers=w)
      next(reader)
      print(f"tsv, {w} workers: first batch after {time.perf_counter() - tic:.2f} s "
            "(worker start-up, the scan of the file)")
      # What a worker holds ready after a pause, measured: about 4 chunks (its
      # buffer, grain's collecting thread's, the one being handed over and parsed).
      ahead = w * (criteo_chunks.BUFFER_CHUNKS + 4) * criteo_chunks.CHUNK_LINES
      name = "tsv, in-process" if w == 0 else f"tsv, {w} workers"
      cases[name] = (reader, args.window, batch, ahead)
      processes[name] = [me] + [p for p in me.children(recursive=True) if p.pid not in before]
    for b in (batch, args.big_batch):
      reader = criteo_binary.CriteoBinaryReader(os.path.join(tmp, "bin"), spec, batch_size=b,
                                                num_epochs=None)
      next(reader)
      cases[f"binary, batch {b:,}"] = (reader, max(20 * args.window, 4 * b), b, 0)
      processes[f"binary, batch {b:,}"] = [me]

    rates = {name: [] for name in cases}
    cpu_here, cpu_all = {name: [] for name in cases}, {name: [] for name in cases}
    for _ in range(args.repeats):
      for name, (reader, examples, b, ahead) in cases.items():
        _read(reader, ahead, b)
        before = (time.process_time(), _cpu(processes[name]))
        tic = time.perf_counter()
        _read(reader, examples, b)
        seconds = time.perf_counter() - tic
        done = -(-examples // b) * b
        rates[name].append(done / seconds)
        cpu_here[name].append((time.process_time() - before[0]) / done * 1e6)
        cpu_all[name].append((_cpu(processes[name]) - before[1]) / done * 1e6)
        # The case's workers fill their buffers again before the next case is timed.
        time.sleep(args.settle)
      record.probe()
    for reader, *_ in cases.values():
      reader.close()

  base = statistics.median(rates[next(iter(rates))])
  print(f"\n{'case':24s} {'min':>11s} {'median':>11s} {'max':>11s}  {'ratio':>6s}  "
        f"{'CPU ms / 1k examples: here':>26s}  {'all':>6s}")
  for name, values in rates.items():
    med = statistics.median(values)
    print(f"{name:24s} {min(values):11,.0f} {med:11,.0f} {max(values):11,.0f}  {med / base:5.2f}x"
          f"  {statistics.median(cpu_here[name]):26.2f}  {statistics.median(cpu_all[name]):6.2f}")
  print("examples/s: min / median / max over the repeats; ratio: of medians, to the "
        "in-process TSV reader")
  record.add_times(rates, unit="examples/s")
  first = next(iter(rates))
  for name, values in list(rates.items())[1:]:
    tag = name.replace(",", "").replace(" ", "_")
    record.ratio(f"{tag}_over_in_process", timing.median_ratio(values, rates[first]))
  record.finish(args.json)
  return 0


if __name__ == "__main__":
  sys.exit(main())
