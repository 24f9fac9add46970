"""What the GPU scheduler puts under the next batch's id exchange: pipelined step vs in-line.

    JAX_PLATFORMS=cpu python benchmarks/pipeline_schedule.py
    JAX_PLATFORMS=cpu python benchmarks/pipeline_schedule.py --overlap-limit 8
    JAX_PLATFORMS=cpu python benchmarks/pipeline_schedule.py --json run.json  # also the record

Compiles the quickstart DLRM's train step (``configs/quickstart.py``, its
planner's layouts, batch ``BATCH``) for 8 H100s without a device
(``embedlib.kernels.deviceless``; needs the CUDA plugin, Python >= 3.12),
in line and pipelined (``embedlib.training.pipelined_train_step``), and
reads the scheduled HLO of each. For every id exchange (all-to-all of ids
to their owners, all-gather of ids) that the schedule runs asynchronously,
it prints the instructions placed between its start and its done, by
opcode, and whether the exchange reads the next batch (pipelined) or this
step's batch (in line). Nothing is run or timed. ``--overlap-limit N``
lets XLA's scheduler keep N collectives in flight at once
(``xla_gpu_experimental_parallel_collective_overlap_limit``; XLA's default
is 1, which keeps step N's lookups, themselves holding all-to-alls, out
from under the next batch's exchange). ``--json FILE`` keeps, per
program and asynchronous exchange, the count of this step's ops under it
(unit ``ops``) in ``benchmarks/timing.py``'s record (no ratios: nothing is
timed).
"""

from __future__ import annotations

import argparse
import collections
import os
import pathlib
import re
import sys

if __name__ == "__main__":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax
from flax import nnx

from benchmarks import timing
from embedlib.kernels import deviceless
from embedlib.plan import hlo
from embedlib.training import pipeline, setup, steps

BATCH = 16384
_PARAMETER = re.compile(r'parameter\(\d+\).*op_name="(?P<arg>[^"]*)"')


entry = hlo.entry_instructions


def opcode(rest: str) -> str:
  """An instruction's opcode: the word after its result shape."""
  word = re.match(r"\s*([a-z][\w\-]*)\(", rest[_shape_end(rest):])
  return word.group(1) if word else ""


def _shape_end(rest: str) -> int:
  depth, i = 0, 0
  for i, ch in enumerate(rest):
    if ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
    elif ch == " " and depth == 0:
      return i
  return i


def reads(lines: dict, name: str) -> set[str]:
  """The entry parameters (argument paths) ``name`` transitively reads."""
  found, todo, seen = set(), [name], set()
  while todo:
    current = todo.pop()
    if current in seen or current not in lines:
      continue
    seen.add(current)
    parameter = _PARAMETER.search(lines[current])
    if parameter:
      found.add(parameter.group("arg").replace("\\", ""))
    todo += re.findall(r"%([\w.\-]+)", lines[current])
  return found


def _what(rest: str) -> str:
  """An instruction's source op, from its metadata: ``dot_general``, ``sort``, ..."""
  name = re.search(r'op_name="([^"]*)"', rest)
  if not name:
    return opcode(rest)
  path = name.group(1)
  stage = "backward" if "transpose(" in path else "forward" if "jvp(" in path else "other"
  return f"{stage} {path.rsplit('/', 1)[-1]}"


def exchanges_and_overlap(text: str):
  """Per async id exchange: ``(start, what it reads, Counter of this step's ops under it)``.

  "This step's ops" are the instructions scheduled between the exchange's
  start and done that read none of the next batch: step N's own work.
  """
  order = entry(text)
  lines = dict(order)
  position = {n: i for i, (n, _) in enumerate(order)}
  out = []
  for name, rest in order:
    op = opcode(rest)
    is_start = op in ("all-to-all-start", "all-gather-start") or (
        op == "async-start" and re.search(r"all-to-all|all-gather", rest))
    if not is_start:
      continue
    done = next((n for n, r in order[position[name] + 1:] if f"%{name}" in r
                 and opcode(r).endswith("done")), None)
    if done is None:
      continue
    args = reads(lines, name)
    if not any("sparse" in a for a in args):
      continue  # not an exchange of ids
    under = [(n, r) for n, r in order[position[name] + 1:position[done]]
             if opcode(r) not in ("get-tuple-element", "bitcast", "parameter", "constant")]
    own = collections.Counter(_what(r) for n, r in under
                              if not any(a.startswith("next_batch") for a in reads(lines, n)))
    out.append((name, sorted(args), len(under), own))
  return out


def collective_counts(text: str) -> collections.Counter:
  """The entry computation's collectives by opcode."""
  return collections.Counter(op for op in (opcode(r) for _, r in entry(text))
                             if re.match(r"(all|reduce|collective)-", op))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--overlap-limit", type=int, default=None)
  timing.add_json_argument(parser)
  args = parser.parse_args(argv)
  record = timing.Run("pipeline_schedule", argv)
  json_path = args.json
  options = ({} if args.overlap_limit is None else
             {"xla_gpu_experimental_parallel_collective_overlap_limit": args.overlap_limit})
  reason = deviceless.unavailable_reason()
  if reason:
    print(f"pipeline_schedule: {reason}")
    return 1
  from configs import quickstart  # pylint: disable=g-import-not-at-top
  from tests.gpu_compile import train_steps  # pylint: disable=g-import-not-at-top

  config = quickstart.get_config()
  config.batch_size = BATCH
  mesh = train_steps.mesh_for(config, "H100")
  graphdef, state, batch = train_steps.abstract_model(config, mesh)
  task = setup.task(config)

  def in_line(state, batch):
    model, optimizer = nnx.merge(graphdef, state)
    loss = steps.train_step(model, optimizer, batch, task=task)
    return loss, nnx.state((model, optimizer))

  def distribute(state, next_batch):
    model, _ = nnx.merge(graphdef, state)
    return pipeline.distribute_batch(model, next_batch, task=task)

  def pipelined(state, batch, distributed, next_batch):
    model, optimizer = nnx.merge(graphdef, state)
    loss, following = pipeline.pipelined_train_step(model, optimizer, batch, distributed,
                                                    next_batch, task=task)
    return loss, following, nnx.state((model, optimizer))

  first = deviceless.gpu_compile(distribute, state, batch, mesh=mesh)
  distributed = jax.tree.map(
      lambda info, s: jax.ShapeDtypeStruct(info.shape, info.dtype, sharding=s),
      first.out_info, first.output_shardings)
  programs = {
      "in line": deviceless.gpu_compile(in_line, state, batch, mesh=mesh, donate_argnums=0,
                                        compiler_options=options),
      "pipelined": deviceless.gpu_compile(pipelined, state, batch, distributed, batch,
                                          mesh=mesh, donate_argnums=(0, 2),
                                          compiler_options=options),
  }
  print(f"quickstart DLRM, batch {BATCH}, 8 x H100 (deviceless compile, scheduled HLO)"
        + (f", collective overlap limit {args.overlap_limit}" if options else ""))
  for name, program in programs.items():
    text = program.as_text()
    found = exchanges_and_overlap(text)
    print(f"{name}: entry collectives {dict(collective_counts(text))}; "
          f"{len(found)} asynchronous id exchanges")
    for start, args, count, own in found:
      whose = "next batch" if any(a.startswith("next_batch") for a in args) else "this batch"
      ops = ", ".join(f"{op} x{n}" for op, n in own.most_common(6)) or "none"
      print(f"  {start} ({whose}): {count} ops under it, {sum(own.values())} of them this "
            f"step's: {ops}")
      record.add_case(f"{name}: {start} ({whose}), this step's ops under it",
                      sum(own.values()), "ops")
  record.finish(json_path)
  return 0


if __name__ == "__main__":
  sys.exit(main())
