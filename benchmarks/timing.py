"""Shared timing helpers for the benchmarks: interleaved repeats, min/median/max.

Benchmarks report ratios against a baseline measured in the same run, never
absolute pass/fail times: these machines are shared and noisy.
"""

from __future__ import annotations

import random
import statistics
import time

import jax


def time_once(fn, *args) -> float:
  start = time.perf_counter()
  jax.block_until_ready(fn(*args))
  return (time.perf_counter() - start) * 1e3


def interleaved(cases: dict, repeats: int, *, shuffle_seed: int | None = None
                ) -> dict[str, list[float]]:
  """Times every case ``repeats`` times, round-robin, after one warm-up each.

  Args:
    cases: name -> (fn, args).
    repeats: timed calls per case.
    shuffle_seed: None keeps the order of ``cases`` every round; a seed
      shuffles each round's order (seeded), so that no case always runs
      behind the same predecessor and inherits its cache footprint and the
      freeing of its buffers.

  Returns:
    name -> list of milliseconds.
  """
  for fn, args in cases.values():
    jax.block_until_ready(fn(*args))
  times = {name: [] for name in cases}
  order, rng = list(cases), random.Random(shuffle_seed)
  for _ in range(repeats):
    if shuffle_seed is not None:
      rng.shuffle(order)
    for name in order:
      fn, args = cases[name]
      times[name].append(time_once(fn, *args))
  return times


def summary(times: list[float]) -> str:
  return f"{min(times):8.2f} {statistics.median(times):8.2f} {max(times):8.2f}"


def print_table(times: dict[str, list[float]], baseline: str, title: str) -> None:
  """Prints min / median / max ms and the median ratio to ``baseline``."""
  base = statistics.median(times[baseline])
  print(f"\n{title}")
  print(f"{'case':44s} {'min':>8s} {'median':>8s} {'max':>8s}  ratio (median / {baseline})")
  for name, ts in times.items():
    print(f"{name:44s} {summary(ts)}  {statistics.median(ts) / base:6.2f}")
