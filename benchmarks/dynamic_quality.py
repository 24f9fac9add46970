"""Dynamic tables against hashed ones on ids far outnumbering the rows: AUC, one run.

    python3 benchmarks/dynamic_quality.py            # 3 seeds x 160k lines, 16,384 rows, ~185k ids
    python3 benchmarks/dynamic_quality.py --smoke    # 12k lines, 2,048 rows: the check only

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
  rows per id), so nothing is evicted.

The check (exit 1 if it fails): the unlimited table ends holding exactly
the distinct ids of the training lines, each in its own row, having
evicted none; every AUC lies between 0.5 and the oracle's (+0.01).
"""

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import embedlib  # noqa: E402
from embedlib import dynamic, optim  # noqa: E402
from embedlib.data import _hashing, criteo_synth  # noqa: E402
from embedlib.metrics import StreamingMetrics  # noqa: E402

SIGNAL = criteo_synth.SIGNAL_SPARSE
FIRST_SPARSE = 14                     # label, 13 integers, then the categoricals


def read(path):
  """Labels, ``log1p`` integer features and raw signal ids (uint64, ``feature << 32 | value``;
  ``2**64 - 1`` where empty) of a Criteo-format file."""
  labels, dense, ids = [], [], []
  pad = np.uint64(2**64 - 1)
  with open(path, encoding="ascii") as f:
    for line in f:
      cols = line.rstrip("\n").split("\t")
      labels.append(int(cols[0]))
      dense.append([np.log1p(max(int(c), 0)) if c else 0.0 for c in cols[1:FIRST_SPARSE]])
      ids.append([(f << 32) | int(cols[FIRST_SPARSE + f], 16) if cols[FIRST_SPARSE + f] else pad
                  for f in SIGNAL])
  return (np.asarray(labels, np.float32), np.asarray(dense, np.float32),
          np.asarray(ids, np.uint64))


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
  return np.where(ids == np.uint64(2**64 - 1), -1, h.astype(np.int64)).astype(np.int32)


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


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--smoke", action="store_true")
  parser.add_argument("--lines", type=int, default=None, help="training lines")
  parser.add_argument("--test", type=int, default=None, help="held-out lines after them")
  parser.add_argument("--rows", type=int, default=None, help="rows of the limited tables")
  parser.add_argument("--vocab-scale", type=float, default=None)
  parser.add_argument("--width", type=int, default=8)
  parser.add_argument("--batch", type=int, default=1024)
  parser.add_argument("--lr", type=float, default=0.1)
  parser.add_argument("--seeds", type=int, default=None, help="data seeds (default 3; smoke 1)")
  args = parser.parse_args(argv)
  lines = args.lines or (12_288 if args.smoke else 163_840)
  test = args.test or (4_096 if args.smoke else 32_768)
  rows = args.rows or (2_048 if args.smoke else 16_384)
  scale = args.vocab_scale or (0.2 if args.smoke else 4.0)
  args.seeds = args.seeds or (1 if args.smoke else 3)
  w = args.width
  row_bytes = 4 * w + 4                               # the row and its AdaGrad slot
  map_bytes = dynamic.Policy(rows).map_bytes_per_row()
  same_memory = int(rows * (row_bytes + map_bytes) / row_bytes)
  results, ok = {}, True
  for seed in range(args.seeds):
    ok &= trial(seed, lines, test, rows, same_memory, scale, args, results)
  print(f"\nAUC on the held-out lines over {args.seeds} data seed(s): min / median / max")
  for name, aucs in results.items():
    print(f"  {name:40s} {min(aucs):.4f} / {np.median(aucs):.4f} / {max(aucs):.4f}")
  print("check:", "ok" if ok else "FAILED")
  return 0 if ok else 1


def trial(seed, lines, test, rows, same_memory, scale, args, results) -> bool:
  """One data seed: every case's AUC appended to ``results``; whether the check holds."""
  synth = criteo_synth.CriteoSynth(seed=seed, vocab_scale=scale)
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "day.tsv")
    synth.write(path, lines + test)
    y, dense, ids = read(path)
  data = {"train": (y[:lines], dense[:lines], ids[:lines]),
          "test": (y[lines:], dense[lines:], ids[lines:])}
  seen = np.unique(ids[:lines][ids[:lines] != np.uint64(2**64 - 1)])
  acc = StreamingMetrics()
  acc.update(y[lines:], logits=criteo_synth.planted_logits(synth, lines + test)[lines:]
             .astype(np.float32))
  oracle = float(acc.result()["auc"])
  w = args.width
  unlimited = -(-4 * len(seen) // 128) * 128
  print(f"seed {seed}: {lines:,} training lines, {test:,} held out, vocab_scale={scale}, "
        f"{len(SIGNAL)} signal features: {len(seen):,} distinct (feature, value) ids in "
        f"training; {rows:,} rows; width {w}; batch {args.batch}; {jax.default_backend()}")
  words = lambda b: dynamic.words(b)
  dyn = lambda cap, eviction: embedlib.DynamicEmbed(cap, w, eviction=eviction,
                                                    rngs=nnx.Rngs(0))
  cases = {
      f"hashed, same rows ({rows:,})":
          (lambda: embedlib.ShardedEmbed(rows, w, rngs=nnx.Rngs(0)),
           lambda b: jnp.asarray(hashed(b, rows))),
      f"hashed, same memory ({same_memory:,} rows)":
          (lambda: embedlib.ShardedEmbed(same_memory, w, rngs=nnx.Rngs(0)),
           lambda b: jnp.asarray(hashed(b, same_memory))),
      f"dynamic LRU ({rows:,})": (lambda: dyn(rows, "lru"), words),
      f"dynamic LFU ({rows:,})": (lambda: dyn(rows, "lfu"), words),
      "dynamic, unlimited (4 rows per id)": (lambda: dyn(unlimited, None), words),
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
        resident = model.table.resident()
        exact = (sorted(resident) == seen.tolist()
                 and len(set(resident.values())) == len(resident))
        ok &= exact
        extra += f"  holds every training id in its own row: {exact}"
    ok &= 0.5 < auc <= oracle + 0.01
    print(f"  {name:40s} AUC {auc:.4f}  ({time.perf_counter() - start:.0f} s){extra}")
  results.setdefault("planted oracle", []).append(oracle)
  print(f"  {'planted oracle':40s} AUC {oracle:.4f}")
  return ok

if __name__ == "__main__":
  sys.exit(main())
