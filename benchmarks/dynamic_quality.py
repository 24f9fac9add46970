"""Dynamic tables against hashed ones on ids far outnumbering the rows: AUC, one run.

    python3 benchmarks/dynamic_quality.py            # 3 seeds x 160k lines, 16,384 rows, ~185k ids
    python3 benchmarks/dynamic_quality.py --smoke    # 12k lines, 2,048 rows: the check only
    python3 benchmarks/dynamic_quality.py --large    # 1 seed x 20.5M lines, 2**20 rows, ~10M ids
    python3 benchmarks/dynamic_quality.py --json run.json  # also the run's record (timing.Run)

The data is a Criteo-format file written by ``embedlib.data.criteo_synth``
(``vocab_scale`` widens every feature's vocabulary) and read back as raw
32-bit values. Its label is planted on the identity of eight categorical
features' values (one effect per value) and four integer features; the
planted probabilities' AUC on the held-out lines (the oracle) bounds every
model's. The model is logistic regression: one table (the eight signal
features' values keyed by ``(feature, value)``, one step per batch),
``features`` wide, a linear head over the rows and the 13 integer features;
row-wise AdaGrad for the table, Adam for the head; one pass over the
training lines, then AUC on the next ``--test`` lines.

- hashed, same rows: ``ShardedEmbed(rows)`` with ``hash(feature, value) mod rows``,
  as ``embedlib.data.criteo`` does: distinct ids share rows;
- hashed, same memory: the same with the rows the dynamic map's bytes buy
  (``rows * (row + slot + map) / (row + slot)`` bytes per row);
- dynamic LRU / LFU: ``DynamicEmbed(rows)``, admitted on first sight,
  evicting; an id not resident reads zeros;
- dynamic, unlimited: ``DynamicEmbed`` with room for every id seen (four
  rows per id; two with ``--large``), so nothing is evicted.

The file is written block by block and parsed in chunks, column by column,
into preallocated arrays, so ``--large`` needs memory for its numbers rather
than for tens of millions of Python lists.

The check (exit 1 if it fails): the unlimited table ends holding exactly
the distinct ids of the training lines, each in its own row, having
evicted none; every AUC lies between 0.5 and the oracle's (+0.01).

``--json FILE`` keeps the run's record (``benchmarks/timing.py``): each
case's AUC over the seeds (unit ``AUC``), and as its named figures the AUC
differences ``lru_minus_hashed_same_memory`` and
``lfu_minus_hashed_same_memory`` (medians over the seeds), beside the
machine's state (a copy probe after each seed).
"""

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import embedlib  # noqa: E402
from embedlib import dynamic, optim  # noqa: E402
from embedlib.data import _hashing, criteo_synth  # noqa: E402
from embedlib.metrics import StreamingMetrics  # noqa: E402
import timing  # noqa: E402

SIGNAL = criteo_synth.SIGNAL_SPARSE
FIRST_SPARSE = 14                     # label, 13 integers, then the categoricals
PAD = np.uint64(2**64 - 1)            # an empty field: no id


def read(path, num_lines, *, chunk_bytes=1 << 26):
  """Labels ``[num_lines]``, ``log1p`` integer features ``[num_lines, 13]`` and raw signal ids
  ``[num_lines, len(SIGNAL)]`` (uint64, ``feature << 32 | value``; ``2**64 - 1`` where empty)
  of the first ``num_lines`` lines of a Criteo-format file.

  Lines are parsed column by column in chunks into preallocated arrays, so files of tens of
  millions of lines fit in memory as numbers rather than as Python objects.
  """
  labels = np.empty(num_lines, np.float32)
  dense = np.empty((num_lines, FIRST_SPARSE - 1), np.float32)
  ids = np.empty((num_lines, len(SIGNAL)), np.uint64)
  done = 0
  with open(path, "rb") as f:
    while done < num_lines:
      lines = f.readlines(chunk_bytes)[:num_lines - done]
      if not lines:
        raise ValueError(f"{path}: {done:,} lines, fewer than the {num_lines:,} asked for; "
                         "write the file with at least that many lines.")
      n = len(lines)
      rows = slice(done, done + n)
      cols = _columns(b"".join(lines), n, path)
      labels[rows] = _integers(cols(0))[0]
      for j in range(1, FIRST_SPARSE):
        value, empty = _integers(cols(j))
        dense[rows, j - 1] = np.where(empty, 0.0, np.log1p(np.maximum(value, 0)))
      for k, feature in enumerate(SIGNAL):
        value, empty = _hex(cols(FIRST_SPARSE + feature), path)
        ids[rows, k] = np.where(empty, PAD, (np.uint64(feature) << np.uint64(32)) | value)
      done += n
  return labels, dense, ids


def _columns(text, n, path):
  """A function from a column index to that column of ``n`` tab-separated lines, as bytes."""
  fields = text.replace(b"\n", b"\t").split(b"\t")[:-1]
  width = FIRST_SPARSE + criteo_synth.CRITEO_NUM_SPARSE
  if len(fields) != n * width:
    raise ValueError(f"{path}: {len(fields):,} fields in {n:,} lines; a Criteo line has "
                     f"{width} tab-separated fields (label, 13 integers, 26 categoricals).")
  return lambda j: np.array(fields[j::width])


def _integers(col):
  """Decimal byte strings as int64 (0 where empty), and where they are empty."""
  empty = col == b""
  return np.where(empty, b"0", col).astype(np.int64), empty


def _hex(col, path):
  """Hexadecimal byte strings (at most 8 digits) as uint64 (0 where empty), and where empty."""
  if col.dtype.itemsize > 8:
    raise ValueError(f"{path}: a categorical value has {col.dtype.itemsize} characters; the "
                     "ids keep 32 bits of value, so values must be at most 8 hex digits.")
  chars = col.view(np.uint8).reshape(len(col), col.dtype.itemsize)
  ranges = [(chars >= lo) & (chars <= hi) for lo, hi in (b"09", b"af", b"AF")]
  digits = np.select(ranges, [chars - 48, chars - 87, chars - 55], 0).astype(np.uint64)
  present = chars != 0
  if np.any(present & ~(ranges[0] | ranges[1] | ranges[2])):
    raise ValueError(f"{path}: a categorical value is not hexadecimal (0-9, a-f).")
  value = np.zeros(len(col), np.uint64)
  for k in range(chars.shape[1]):
    value = np.where(present[:, k], value * np.uint64(16) + digits[:, k], value)
  return value, col == b""


class Model(nnx.Module):
  def __init__(self, table, width, *, rngs):
    self.table = table
    self.head = nnx.Linear(len(SIGNAL) * width + 13, 1, rngs=rngs)

  def __call__(self, ids, dense):
    rows = self.table(ids)
    return self.head(jnp.concatenate([rows.reshape(rows.shape[0], -1), dense], 1))[:, 0]


def hashed(ids, rows):
  """Each id's row in a hashed table (``-1`` where empty)."""
  h = _hashing.hash_u64(_hashing.derive_key(0, "dynamic_quality"), ids) % np.uint64(rows)
  return np.where(ids == PAD, -1, h.astype(np.int64)).astype(np.int32)


def loss_fn(model, ids, dense, y):
  return jnp.mean(optax.sigmoid_binary_cross_entropy(model(ids, dense), y))


@nnx.jit(donate_argnums=(0, 1))
def step(model, opt, ids, dense, y):
  loss, grads = optim.value_and_grad(loss_fn)(model, ids, dense, y)
  dynamic.reset_slots(opt, model)
  opt.update(model, grads)
  return loss


@nnx.jit
def predict(model, ids, dense):
  return model(ids, dense)


def run(table, to_ids, data, batch, lr):
  """Trains on ``data["train"]`` one pass; the AUC on ``data["test"]`` and the model."""
  model = Model(table, table.features if hasattr(table, "features") else table.embedding.shape[1],
                rngs=nnx.Rngs(1))
  opt = optim.SparseAwareOptimizer(model, optax.adam(1e-2),
                                   optim.RowWiseAdagrad(learning_rate=lr))
  y, dense, ids = data["train"]
  for s in range(0, len(y) - batch + 1, batch):
    step(model, opt, to_ids(ids[s:s + batch]), jnp.asarray(dense[s:s + batch]),
         jnp.asarray(y[s:s + batch]))
  model.eval()
  acc = StreamingMetrics()
  y, dense, ids = data["test"]
  for s in range(0, len(y), batch):
    acc.update(y[s:s + batch], logits=np.asarray(
        predict(model, to_ids(ids[s:s + batch]), jnp.asarray(dense[s:s + batch]))))
  return float(acc.result()["auc"]), model


#: Each scale's sizes; ``--lines`` and the other flags override them.
PRESETS = {
    "default": dict(lines=163_840, test=32_768, rows=16_384, vocab_scale=4.0, seeds=3,
                    rows_per_id=4),
    "smoke": dict(lines=12_288, test=4_096, rows=2_048, vocab_scale=0.2, seeds=1,
                  rows_per_id=4),
    # About 10M distinct ids against 2**20 rows. Four rows per id would make the unlimited
    # table 40M rows; two still leave its buckets of 128 half full, too far from full to
    # turn an id away.
    "large": dict(lines=20_480_000, test=1_048_576, rows=1_048_576, vocab_scale=80.0, seeds=1,
                  rows_per_id=2),
}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  scale = parser.add_mutually_exclusive_group()
  scale.add_argument("--smoke", action="store_true", help="one small seed: the check only")
  scale.add_argument("--large", action="store_true",
                     help="one seed of 20.5M lines, ~10M distinct ids, 2**20 rows")
  parser.add_argument("--lines", type=int, default=None, help="training lines")
  parser.add_argument("--test", type=int, default=None, help="held-out lines after them")
  parser.add_argument("--rows", type=int, default=None, help="rows of the limited tables")
  parser.add_argument("--vocab-scale", type=float, default=None)
  parser.add_argument("--rows-per-id", type=int, default=None,
                      help="rows of the unlimited table per distinct training id")
  parser.add_argument("--width", type=int, default=8)
  parser.add_argument("--batch", type=int, default=1024)
  parser.add_argument("--lr", type=float, default=0.1)
  parser.add_argument("--seeds", type=int, default=None, help="data seeds")
  timing.add_json_argument(parser)
  args = parser.parse_args(argv)
  record = timing.Run("dynamic_quality", argv, smoke=args.smoke)
  preset = PRESETS["smoke" if args.smoke else "large" if args.large else "default"]
  for name, value in preset.items():
    if getattr(args, name) is None:
      setattr(args, name, value)
  if min(args.lines, args.test, args.rows, args.rows_per_id, args.seeds) < 1:
    parser.error("--lines, --test, --rows, --rows-per-id and --seeds must be at least 1.")
  if args.lines % args.batch:
    parser.error(f"--lines={args.lines} must be a multiple of --batch={args.batch}: training "
                 "drops a partial batch, and the unlimited table must see every training id.")
  w = args.width
  row_bytes = 4 * w + 4                               # the row and its AdaGrad slot
  map_bytes = dynamic.Policy(args.rows).map_bytes_per_row()
  same_memory = int(args.rows * (row_bytes + map_bytes) / row_bytes)
  results, ok = {}, True
  for seed in range(args.seeds):
    ok &= trial(seed, same_memory, args, results)
    record.probe()
  print(f"\nAUC on the held-out lines over {args.seeds} data seed(s): min / median / max")
  for name, aucs in results.items():
    print(f"  {name:40s} {min(aucs):.4f} / {np.median(aucs):.4f} / {max(aucs):.4f}")
  print("check:", "ok" if ok else "FAILED")
  record.add_times(results, unit="AUC")
  same = next(aucs for name, aucs in results.items() if name.startswith("hashed, same memory"))
  for kind in ("LRU", "LFU"):
    aucs = next(a for name, a in results.items() if name.startswith(f"dynamic {kind}"))
    record.ratio(f"{kind.lower()}_minus_hashed_same_memory",
                 float(np.median(aucs) - np.median(same)))
  if not ok:
    record.note("the check FAILED")
  record.finish(args.json)
  return 0 if ok else 1


def write(synth, path, num_lines, last):
  """Writes ``num_lines`` lines as ``synth.write`` does; the planted logits of the ``last``."""
  ps = []
  with open(path, "w", encoding="ascii") as f:
    for lines, p in synth.blocks(num_lines):
      f.write("\n".join(lines) + "\n")
      ps.append(p[-last:])
  p = np.concatenate(ps)[-last:]
  return np.log(p) - np.log1p(-p)


def make_data(seed, args):
  """One seed's train and test arrays, its distinct training ids and the oracle's test AUC."""
  lines, test = args.lines, args.test
  synth = criteo_synth.CriteoSynth(seed=seed, vocab_scale=args.vocab_scale)
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "day.tsv")
    planted = write(synth, path, lines + test, test)
    y, dense, ids = read(path, lines + test)
  data = {"train": (y[:lines], dense[:lines], ids[:lines]),
          "test": (y[lines:], dense[lines:], ids[lines:])}
  seen = np.unique(ids[:lines][ids[:lines] != PAD])
  acc = StreamingMetrics()
  acc.update(y[lines:], logits=planted.astype(np.float32))
  return data, seen, float(acc.result()["auc"])


def holds_exactly(table, seen) -> bool:
  """Whether ``table`` holds exactly the ids ``seen`` (sorted uint64), each in its own row."""
  resident = table.resident()
  keys = np.fromiter(resident.keys(), np.uint64, len(resident))
  rows = np.fromiter(resident.values(), np.int64, len(resident))
  return np.array_equal(np.sort(keys), seen) and len(np.unique(rows)) == len(rows)


def trial(seed, same_memory, args, results) -> bool:
  """One data seed: every case's AUC appended to ``results``; whether the check holds."""
  start = time.perf_counter()
  data, seen, oracle = make_data(seed, args)
  lines, test, rows, w = args.lines, args.test, args.rows, args.width
  unlimited = -(-args.rows_per_id * len(seen) // 128) * 128
  print(f"seed {seed}: {lines:,} training lines, {test:,} held out, "
        f"vocab_scale={args.vocab_scale}, {len(SIGNAL)} signal features: {len(seen):,} distinct "
        f"(feature, value) ids in training; {rows:,} rows; width {w}; batch {args.batch}; "
        f"{jax.default_backend()}; data written and read in {time.perf_counter() - start:.0f} s")
  words = lambda b: dynamic.words(b)
  dyn = lambda cap, eviction: embedlib.DynamicEmbed(
      cap, w, dynamic=embedlib.DynamicSpec(eviction=eviction), rngs=nnx.Rngs(0))
  cases = {
      f"hashed, same rows ({rows:,})":
          (lambda: embedlib.ShardedEmbed(rows, w, rngs=nnx.Rngs(0)),
           lambda b: jnp.asarray(hashed(b, rows))),
      f"hashed, same memory ({same_memory:,} rows)":
          (lambda: embedlib.ShardedEmbed(same_memory, w, rngs=nnx.Rngs(0)),
           lambda b: jnp.asarray(hashed(b, same_memory))),
      f"dynamic LRU ({rows:,})": (lambda: dyn(rows, "lru"), words),
      f"dynamic LFU ({rows:,})": (lambda: dyn(rows, "lfu"), words),
      f"dynamic, unlimited ({args.rows_per_id} rows per id)":
          (lambda: dyn(unlimited, None), words),
  }
  ok = True
  for name, (make, to_ids) in cases.items():
    start = time.perf_counter()
    auc, model = run(make(), to_ids, data, args.batch, args.lr)
    results.setdefault(name, []).append(auc)
    extra = ""
    if isinstance(model.table, embedlib.DynamicEmbed):
      extra = f"  (last step: {model.table.stats()})"
      if model.table.policy.eviction is None:
        exact = holds_exactly(model.table, seen)
        ok &= exact
        extra += f"  holds every training id in its own row: {exact}"
    ok &= 0.5 < auc <= oracle + 0.01
    print(f"  {name:40s} AUC {auc:.4f}  ({time.perf_counter() - start:.0f} s){extra}",
          flush=True)
  results.setdefault("planted oracle", []).append(oracle)
  print(f"  {'planted oracle':40s} AUC {oracle:.4f}")
  return ok


if __name__ == "__main__":
  sys.exit(main())
