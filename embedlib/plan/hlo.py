"""Bytes a compiled program moves between devices, read from its HLO text.

The check on the cost model: ``plan.bytes_moved_per_lookup`` must agree with
what XLA actually compiled. Each collective counts the bytes one device
receives, with the ring volumes the cost model uses: of a buffer spread
over ``k`` devices, an all-gather, reduce-scatter or all-to-all moves
``(k - 1) / k`` of the whole, an all-reduce twice that, a
collective-permute all of it. A ``conditional`` counts its first branch
(index 0, a ``lax.cond``'s false branch): embedlib writes its fallbacks as
``lax.cond(overflow, fallback, normal)``, so that is the step that doesn't
overflow. Every other called computation counts once (a ``while`` body per
trip is beyond a static count).

Pure Python: it reads the text of ``jax.jit(f).lower(...).compile().as_text()``.
"""

from __future__ import annotations

import math
import re

_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}
_KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_SHAPE = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([0-9,]*)\]")
_OP = re.compile(
    r"=\s*(?P<result>.*?)\s(?P<op>" + "|".join(_KINDS) + r")(?P<start>-start)?\("
)
_COMPUTATION = re.compile(r"^\s*(ENTRY\s+)?%?(?P<name>[\w.\-]+)\s.*\{\s*$")
_CALLS = re.compile(r"(?:to_apply|calls|body|condition)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


def _result_bytes(result: str, async_start: bool) -> int:
  shapes = [
      _BYTES[t] * math.prod(int(d) for d in dims.split(",") if d)
      for t, dims in _SHAPE.findall(result)
  ]
  if async_start:  # (operands, outputs): the outputs are the second half
    shapes = shapes[len(shapes) // 2:]
  return sum(shapes)


def _group_size(line: str) -> int:
  groups = re.search(r"replica_groups=\{\{([0-9,]*)\}", line)
  if groups:
    return len(groups.group(1).split(","))
  iota = re.search(r"replica_groups=\[(\d+),(\d+)\]", line)
  if iota:
    return int(iota.group(2))
  # Newer XLA names mesh axes: replica_groups=mesh['data'=2,'model'=4] {'model'}
  named = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
  if named:
    sizes = {a: int(n) for a, n in re.findall(r"'([^']+)'=(\d+)", named.group(1))}
    return math.prod(sizes[a] for a in re.findall(r"'([^']+)'", named.group(2)))
  pairs = re.search(r"source_target_pairs=\{(.*?)\}\}?", line)
  return 2 if pairs else 1


def collective_bytes(line: str) -> int:
  """Bytes one device receives from the collective on ``line`` (0 if none).

  >>> collective_bytes("%a = s32[2048]{0} all-gather(%b), replica_groups={{0,1,2,3,4,5,6,7}}")
  7168
  >>> collective_bytes("%r = f32[256,64]{1,0} reduce-scatter(%x), replica_groups=[1,8]<=[8]")
  458752
  >>> collective_bytes("%a = s32[512]{0} all-gather(%b), replica_groups=mesh['d'=2,'b'=8] {'b'}")
  1792
  """
  match = _OP.search(line)
  if not match:
    return 0
  size = _result_bytes(match.group("result"), bool(match.group("start")))
  k = _group_size(line)
  op = match.group("op")
  if op == "collective-permute":
    return size
  if k <= 1:
    return 0
  if op == "all-reduce":
    return 2 * size * (k - 1) // k
  if op == "reduce-scatter":  # the result is one device's 1/k of the operand
    return size * (k - 1)
  return size * (k - 1) // k


def _computations(text: str) -> tuple[dict[str, list[str]], str]:
  comps, entry, current = {}, None, None
  for line in text.splitlines():
    # Headers start at column 0 (instructions are indented); a long
    # parameter list may hold "/*index=5*/" comments.
    head = None if line.startswith((" ", "\t")) else _COMPUTATION.match(line)
    if head:
      current = head.group("name")
      comps[current] = []
      if head.group(1):
        entry = current
      continue
    if current is not None:
      if line.strip() == "}":
        current = None
      else:
        comps[current].append(line)
  return comps, entry


def bytes_moved(text: str) -> int:
  """Bytes one device receives running the compiled program ``text`` once.

  Args:
    text: HLO text of a compiled executable (``compiled.as_text()``).

  Returns:
    The sum over the entry computation's collectives and those of the
    computations it calls (a conditional: its first branch).
  """
  comps, entry = _computations(text)
  memo: dict[str, int] = {}

  def total(name, seen=()):
    if name in memo:
      return memo[name]
    if name not in comps or name in seen:
      return 0
    seen = seen + (name,)
    moved = 0
    for line in comps[name]:
      moved += collective_bytes(line)
      branches = _BRANCHES.search(line)
      if branches:
        moved += total(branches.group(1).split(",")[0].strip().lstrip("%"), seen)
        continue
      false = re.search(r"false_computation=%?([\w.\-]+)", line)
      if false:
        moved += total(false.group(1), seen)
        continue
      moved += sum(total(c, seen) for c in _CALLS.findall(line))
    memo[name] = moved
    return moved

  if entry is None:
    raise ValueError("no ENTRY computation in the HLO text; pass compiled.as_text().")
  return total(entry)
