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
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*(?P<rest>.*)$")


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


def entry_instructions(text: str) -> list[tuple[str, str]]:
  """The ENTRY computation's instructions in order (a compiled program's: scheduled).

  Returns:
    ``(name, rest of the line)`` per instruction, ``rest`` from its shape on.
  """
  comps, entry = _computations(text)
  if entry is None:
    raise ValueError("no ENTRY computation in the HLO text; pass compiled.as_text().")
  return [(m.group("name"), m.group("rest")) for m in map(_INSTRUCTION.match, comps[entry]) if m]


def bytes_moved(text: str, count=None) -> int:
  """Bytes one device receives running the compiled program ``text`` once.

  Args:
    text: HLO text of a compiled executable (``compiled.as_text()``).
    count: bytes of one collective's line (default ``collective_bytes``).

  Returns:
    The sum over the entry computation's collectives and those of the
    computations it calls (a conditional: its first branch).
  """
  count = collective_bytes if count is None else count
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
      moved += count(line)
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


def replica_groups(line: str) -> list[list[int]] | None:
  """The device groups of the collective on ``line``, or None when it names none.

  Reads the explicit (``{{0,1},{2,3}}``), iota (``[2,4]<=[4,2]T(1,0)``) and
  mesh-axis (``mesh['a'=2,'b'=4] {'b'}``) forms.

  >>> replica_groups("x = all-to-all(y), replica_groups={{0,1},{2,3}}")
  [[0, 1], [2, 3]]
  >>> replica_groups("x = all-to-all(y), replica_groups=[2,2]<=[2,2]T(1,0)")
  [[0, 2], [1, 3]]
  >>> replica_groups("x = all-to-all(y), replica_groups=mesh['a'=2,'b'=2] {'a'}")
  [[0, 2], [1, 3]]
  """
  explicit = re.search(r"replica_groups=\{((?:\{[0-9,]*\},?)*)\}", line)
  if explicit:
    return [[int(i) for i in g.split(",") if i]
            for g in re.findall(r"\{([0-9,]*)\}", explicit.group(1))]
  iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", line)
  if iota:
    dims = [int(d) for d in iota.group(3).split(",")]
    ids = _iota(dims, [int(p) for p in iota.group(4).split(",")] if iota.group(4) else None)
    size = int(iota.group(2))
    return [ids[i:i + size] for i in range(0, len(ids), size)]
  named = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
  if named:
    axes = re.findall(r"'([^']+)'=(\d+)", named.group(1))
    names, dims = [a for a, _ in axes], [int(n) for _, n in axes]
    inside = [names.index(a) for a in re.findall(r"'([^']+)'", named.group(2))]
    perm = [i for i in range(len(dims)) if i not in inside] + inside
    ids = _iota(dims, perm)
    size = math.prod(dims[i] for i in inside)
    return [ids[i:i + size] for i in range(0, len(ids), size)]
  return None


def _iota(dims, perm):
  """``arange(prod(dims)).reshape(dims).transpose(perm).ravel()``, without numpy."""
  perm = perm or list(range(len(dims)))
  strides = [math.prod(dims[i + 1:]) for i in range(len(dims))]
  out = []

  def walk(axis, offset):
    if axis == len(perm):
      out.append(offset)
      return
    for i in range(dims[perm[axis]]):
      walk(axis + 1, offset + i * strides[perm[axis]])

  walk(0, 0)
  return out


def inter_node_collective_bytes(line: str, devices_per_node: int) -> int:
  """Bytes a device receives from other nodes in the collective on ``line`` (the most any does).

  Devices ``n * devices_per_node`` to ``(n + 1) * devices_per_node - 1``
  are node ``n``. Each peer of a group sends a device an equal share of
  ``collective_bytes`` (the ring volumes): the share of the peers in other
  nodes crosses.

  >>> line = "%a = s32[8]{0} all-to-all(%b), replica_groups={{0,1,2,3},{4,5,6,7}}"
  >>> inter_node_collective_bytes(line, 4), inter_node_collective_bytes(line, 2)
  (0, 16)
  """
  moved = collective_bytes(line)
  if not moved:
    return 0
  node = lambda d: d // devices_per_node
  pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", line)
  if pairs and "collective-permute" in line:
    crossing = [node(int(s)) != node(int(t))
                for s, t in re.findall(r"\{?(\d+),(\d+)\}?", pairs.group(1) + "}")]
    return moved if any(crossing) else 0
  groups = replica_groups(line)
  if not groups:
    return 0
  worst = 0
  for group in groups:
    for d in group:
      others = sum(node(p) != node(d) for p in group)
      worst = max(worst, moved * others // max(len(group) - 1, 1))
  return worst


def inter_node_bytes(text: str, devices_per_node: int) -> int:
  """Bytes a device receives from other nodes running the compiled program ``text`` once.

  As ``bytes_moved``, each collective counted by
  ``inter_node_collective_bytes``: nodes of ``devices_per_node``
  consecutive device ids.
  """
  return bytes_moved(text, lambda line: inter_node_collective_bytes(line, devices_per_node))
