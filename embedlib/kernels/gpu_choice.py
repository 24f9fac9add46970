"""What ``kernel="auto"`` runs on a GPU: the fastest variant the newest GPU sweep measured.

``bash benchmarks/gpu_session.sh --confirm --json FILE`` times, on one GPU,
every kernel's variants beside XLA's ops (``benchmarks/gpu_sweep.py``),
twice, and keeps its cases as ``benchmarks/results/gpu_<date>.json`` and
``gpu_<date>_confirm.json``; ``python benchmarks/gpu_table.py`` turns the
newest date's files into ``gpu_measured.py`` by `table_from_results`, and
`choose` reads that table. No figure is copied by hand. For each kernel,
dtype, row width and bag size the sweep measured, the chosen variant is the
one whose *worst* speed-up over the best XLA path (across the id
distributions, uniform and Zipf, the tables and the two runs) is largest,
when that is above 1; else XLA's ops. A lookup matches a measured width
within a factor of two (and the nearer of two measured ones), a bag size
likewise; anything the sweep did not measure runs `FALLBACK`, XLA's ops.

With no results file, the table is empty and every GPU lookup runs XLA's
ops: the first H200 run (``benchmarks/README.md``, "The first GPU run")
measured the Mosaic GPU kernels at 0.13x to 0.54x XLA (each row a TMA copy
issued from one thread) and the first Triton kernels at 0.32x to 1.60x.

The kernels the sweep can pick are the Triton ones that keep many rows in
flight (``gather_rows``, ``bag_rows``, ``segment_rows``, ``update_rows``,
``quant/bag_rows``): Triton because a program there loads a ``[rows,
width]`` tile straight into registers with 16-byte vector loads from every
thread (``benchmarks/gpu_static.py`` reads them off the PTX), while Mosaic
GPU on Hopper moves a gathered row only as a TMA copy that one thread issues
(no gather TMA before Blackwell). JAX deprecates its Pallas Triton backend
from 0.11 on: where it goes, the table's Triton choices go with it and XLA's
ops run (`FALLBACK`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import re

import jax.numpy as jnp

#: What runs where the table has no choice: XLA's ops (``"pallas"``: the
#: backend's Pallas kernels, as before the first GPU run; tests of the
#: kernels inside programs ``auto`` builds set it).
FALLBACK = "xla"
#: Variants that are XLA's own ops (the baselines a Pallas variant must beat).
XLA_VARIANTS = ("xla", "xla-slots", "xla-sorted", "xla-ops")
#: Variant prefixes ``auto`` can run (`dispatch`, ``optim/fused_gpu.py``).
RUNNABLE = ("triton-rows-",)
#: The dtype a measurement stands for when none was measured for a lookup's own.
SAME_BYTES = {"float16": "bfloat16"}
#: Kinds of the table and the results' ``kernel`` names they come from.
KINDS = ("gather", "bag", "backward", "update-sgd", "update-adagrad", "update-adam")


@dataclasses.dataclass(frozen=True)
class Choice:
  """What ``auto`` runs for lookups of ``kind`` and ``dtype`` in the given closed ranges.

  ``bag``: ids a bag for bags, ``(0, 0)`` otherwise. ``speedup``: the
  variant's worst speed-up over the best XLA path where it was measured.
  """

  kind: str
  dtype: str
  features: tuple[int, int]
  bag: tuple[int, int]
  variant: str
  speedup: float

  def matches(self, kind, dtype, features, bag) -> bool:
    return (self.kind == kind and self.dtype == dtype
            and self.features[0] <= features <= self.features[1]
            and self.bag[0] <= bag <= self.bag[1])


_USING: contextvars.ContextVar = contextvars.ContextVar("gpu_choice_table", default=None)


def _default_table() -> tuple[Choice, ...]:
  if _USING.get() is not None:
    return _USING.get()
  from embedlib.kernels import gpu_measured  # pylint: disable=g-import-not-at-top

  return tuple(Choice(*row) for row in gpu_measured.CHOICES)


@contextlib.contextmanager
def using(table):
  """Within the block, `choose` reads ``table`` (`Choice` s) in place of the generated one.

  For the sweep's steps, which run ``auto`` on the table the same run just
  measured, and for tests. The choice is made when a program is traced, so
  jax's caches are cleared on entry and exit.
  """
  import jax  # pylint: disable=g-import-not-at-top

  token = _USING.set(tuple(table))
  jax.clear_caches()
  try:
    yield
  finally:
    _USING.reset(token)
    jax.clear_caches()


def choose(kind: str, features: int, dtype, *, bag: int = 0, table=None) -> str | None:
  """The variant ``auto`` runs on a GPU for this lookup, or None (run `FALLBACK`).

  Args:
    kind: one of `KINDS`.
    features: the (local) table's row width.
    dtype: the table's dtype, or ``"int8"`` / ``"int4"`` for quantized rows.
    bag: ids a bag (bags only).
    table: `Choice` s (default: the generated ``gpu_measured.CHOICES``, or
      the table of an enclosing `using` block).

  >>> rule = Choice("gather", "float32", (32, 90), (0, 0), "triton-rows-gather-r64-w4", 1.3)
  >>> choose("gather", 64, jnp.float32, table=(rule,)), choose("gather", 128, "float32", table=(rule,))
  ('triton-rows-gather-r64-w4', None)
  """
  table = _default_table() if table is None else table
  name = dtype if isinstance(dtype, str) else jnp.dtype(dtype).name
  for candidate in (name, SAME_BYTES.get(name)):
    for choice in table:
      if candidate and choice.matches(kind, candidate, features, bag):
        return None if choice.variant in XLA_VARIANTS else choice.variant
  return None


def runs_xla(kind: str, features: int, dtype, *, bag: int = 0, table=None) -> bool:
  """Whether ``auto`` runs XLA's ops for this lookup on a GPU (no choice, and `FALLBACK` is XLA)."""
  return choose(kind, features, dtype, bag=bag, table=table) is None and FALLBACK == "xla"


def _kind(kernel: str) -> tuple[str, int]:
  m = re.fullmatch(r"bag(\d+)", kernel)
  return ("bag", int(m.group(1))) if m else (kernel, 0)


def _ranges(measured: list[int]) -> dict[int, tuple[int, int]]:
  """Each measured size's range: within 2x of it, and nearer it than its neighbours (geometric)."""
  measured = sorted(set(measured))
  out = {}
  for i, w in enumerate(measured):
    lo, hi = max(1, -(-w // 2)), 2 * w
    if i:
      lo = max(lo, math.isqrt(measured[i - 1] * w) + 1)
    if i + 1 < len(measured):
      hi = min(hi, math.isqrt(w * measured[i + 1]))
    out[w] = (lo, hi)
  return out


def table_from_results(cases: list[dict]) -> tuple[Choice, ...]:
  """The choices a GPU sweep's cases imply (see the module docstring).

  Args:
    cases: the results file's list; each case has ``kernel`` (``gather``,
      ``bag16``, ``backward``, ``update-sgd``, ...), ``variant``, ``shape``
      (``[rows, features]``), ``dtype``, ``ids`` and ``median_us``, and
      ``run`` where several sweeps' cases are given (a confirming rerun:
      each run's measurements are cases apart, so a variant must win in
      every run that measured it).
      Cases with ``"check": false`` (a variant that failed its check) are
      left out.

  Returns:
    One `Choice` per measured (kind, dtype, width, bag size), sorted.

  >>> cases = [dict(kernel="gather", variant=v, shape=[100, 64], dtype="float32", ids=d,
  ...               median_us=t) for v, d, t in [("xla", "uniform", 10.0), ("xla", "zipf", 8.0),
  ...               ("triton-rows-gather-r32-w4", "uniform", 5.0),
  ...               ("triton-rows-gather-r32-w4", "zipf", 6.0)]]
  >>> table_from_results(cases)
  (Choice(kind='gather', dtype='float32', features=(32, 128), bag=(0, 0), variant='triton-rows-gather-r32-w4', speedup=1.333),)
  """
  groups: dict[tuple, dict[tuple, dict[str, float]]] = {}
  for case in cases:
    if case.get("check", True) is False:
      continue
    kind, bag = _kind(case["kernel"])
    if kind not in KINDS:
      continue
    key = (kind, case["dtype"], int(case["shape"][1]), bag)
    where = (tuple(case["shape"]), case["ids"], case.get("run", 0))
    groups.setdefault(key, {}).setdefault(where, {})[case["variant"]] = float(case["median_us"])
  widths, bags = {}, {}
  for kind, dtype, features, bag in groups:
    widths.setdefault((kind, dtype), []).append(features)
    bags.setdefault((kind, dtype, features), []).append(bag)
  table = []
  for (kind, dtype, features, bag), by_case in sorted(groups.items()):
    worst: dict[str, float] = {}
    for times in by_case.values():
      base = min((t for v, t in times.items() if v in XLA_VARIANTS), default=None)
      if base is None:
        continue
      for variant, t in times.items():
        if variant.startswith(RUNNABLE):
          worst[variant] = min(worst.get(variant, math.inf), base / t)
    complete = {v: s for v, s in worst.items()
                if all(v in times for times in by_case.values())}
    variant, speedup = max(complete.items(), key=lambda kv: (kv[1], kv[0]),
                           default=("xla", 1.0))
    if speedup <= 1.0:
      variant, speedup = "xla", 1.0
    bag_range = _ranges(bags[kind, dtype, features])[bag] if bag else (0, 0)
    table.append(Choice(kind, dtype, _ranges(widths[kind, dtype])[features], bag_range, variant,
                        round(speedup, 3)))
  return tuple(table)


def module_text(table: tuple[Choice, ...], source: str | None) -> str:
  """The text of ``gpu_measured.py`` for ``table``, generated from results file ``source``."""
  lines = [
      f'"""Generated by ``python benchmarks/gpu_table.py`` from {source or "no results file"}: '
      'do not edit.',
      "",
      "`gpu_choice.choose` reads `CHOICES`: ``(kind, dtype, features, bag, variant, speedup)``",
      "per measured lookup (`gpu_choice.Choice`). Empty: every GPU lookup runs XLA's ops.",
      '"""',
      "",
      f"SOURCE = {source!r}",
      "CHOICES = (",
  ]
  for c in table:
    lines.append(f"    ({c.kind!r}, {c.dtype!r}, {c.features!r}, {c.bag!r}, {c.variant!r}, "
                 f"{c.speedup!r}),")
  lines.append(")")
  return "\n".join(lines) + "\n"
