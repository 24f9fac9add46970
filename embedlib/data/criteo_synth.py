"""Criteo-format TSV files of any size with a planted label, streamed block by block.

    python -m embedlib.data.criteo_synth day.tsv --lines 200000 [--seed 0] [--gzip]

Each line has the real layout (``embedlib.data.criteo``): the 0/1 label, 13
integer fields and 26 categorical fields, tab-separated, with the real
files' quirks: empty fields at per-feature rates (some features empty in
most lines), small negative integers in ``I2``, heavy-tailed counts, and
categoricals as 8 lowercase hex digits whose frequencies follow a Zipf law
over a per-feature vocabulary (from 3 values to ``100_000 * vocab_scale``).

The label is planted: ``P(click) = sigmoid(logit)`` with ``logit`` a sum of
a bias, weights on ``log1p`` of four integer features and one effect per
value of eight categorical features (``planted_logits``), so a model that
reads the file through ``CriteoReader`` can learn it, and the oracle's AUC
and log-loss (``oracle_metrics``) bound what it can reach.

Lines come in blocks of ``BLOCK`` from a generator keyed by ``(seed, block)``:
memory stays constant whatever the number of lines, the same seed gives the
same bytes, and a shorter file is a prefix of a longer one.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import os
import sys
from collections.abc import Iterator

import numpy as np

from embedlib.data import _hashing
from embedlib.data.criteo import CRITEO_NUM_DENSE, CRITEO_NUM_SPARSE

#: Lines drawn at once; part of the format of a seed's stream (changing it changes the bytes).
BLOCK = 4096
#: Per-feature vocabulary at ``vocab_scale=1``: a few tiny, most in the thousands, some large,
#: as in the real day files (scaled down from their millions).
VOCAB = (1_460, 583, 100_000, 50_000, 305, 24, 12_517, 633, 3, 93_145, 5_683, 80_000, 3_194,
         27, 14_992, 60_000, 10, 5_652, 2_173, 4, 70_000, 18, 15, 28_611, 105, 14_236)
#: Empty-field rates: the integers' as in the real files (I12 is mostly empty), and
#: categoricals mostly present with a few often empty.
EMPTY_DENSE = (0.45, 0.0, 0.21, 0.22, 0.03, 0.22, 0.04, 0.0, 0.04, 0.45, 0.04, 0.77, 0.22)
EMPTY_SPARSE = (0.0, 0.0, 0.03, 0.03, 0.0, 0.12, 0.0, 0.0, 0.0, 0.03, 0.0, 0.03, 0.0, 0.0,
                0.0, 0.03, 0.0, 0.0, 0.44, 0.44, 0.03, 0.76, 0.0, 0.03, 0.44, 0.44)
#: Which features carry the planted signal, and how strongly.
SIGNAL_DENSE = {0: 0.35, 2: -0.25, 5: 0.2, 10: 0.3}
SIGNAL_SPARSE = (0, 2, 3, 5, 8, 11, 15, 20)
SIGNAL_SPARSE_SCALE = 0.6
#: Chosen so that about a quarter of the lines are clicks, as in Criteo.
BIAS = -1.6


@dataclasses.dataclass(frozen=True)
class CriteoSynth:
  """A deterministic stream of Criteo lines with a planted click probability.

  >>> synth = CriteoSynth(seed=0)
  >>> lines, p = next(synth.blocks(3))
  >>> len(lines), len(lines[0].split("\\t")), p.shape
  (3, 40, (3,))

  Args:
    seed: the stream (labels, values, vocabularies and effects).
    vocab_scale: multiplies every feature's vocabulary size (at least 1 value).
    zipf_exponent: skew of the categorical frequencies (value of rank r is
      drawn with weight ``r ** -zipf_exponent``).
  """

  seed: int = 0
  vocab_scale: float = 1.0
  zipf_exponent: float = 1.05

  def __post_init__(self):
    if self.vocab_scale <= 0 or self.zipf_exponent < 0:
      raise ValueError(f"CriteoSynth: vocab_scale={self.vocab_scale} must be > 0 and "
                       f"zipf_exponent={self.zipf_exponent} >= 0; pass e.g. vocab_scale=1, "
                       "zipf_exponent=1.05.")
    key = _hashing.derive_key(self.seed, "criteo_synth")
    vocab = [max(1, int(round(v * self.vocab_scale))) for v in VOCAB]
    cdfs, hexes, effects = [], [], []
    for i, size in enumerate(vocab):
      ranks = np.arange(size, dtype=np.uint64)
      weights = (ranks + 1.0) ** -self.zipf_exponent
      cdfs.append(np.cumsum(weights) / weights.sum())
      # Values of rank r, as 8 hex digits: a hash, so frequent values look like any other.
      values = _hashing.hash_u64(_hashing.derive_key(key, "value", i), ranks) >> np.uint64(32)
      hexes.append(np.char.mod("%08x", values.astype(np.int64)).astype(object))
      effect = np.zeros(size)
      if i in SIGNAL_SPARSE:
        effect = SIGNAL_SPARSE_SCALE * _hashing.normal(
            _hashing.hash_u64(_hashing.derive_key(key, "effect", i), ranks))
      effects.append(effect)
    object.__setattr__(self, "_key", key)
    object.__setattr__(self, "_tables", (cdfs, hexes, effects))

  def blocks(self, num_lines: int) -> Iterator[tuple[list[str], np.ndarray]]:
    """``(lines without newlines, click probabilities [len(lines)])``, ``BLOCK`` at a time."""
    for start in range(0, num_lines, BLOCK):
      lines, p = self._block(start // BLOCK)
      stop = min(BLOCK, num_lines - start)
      yield lines[:stop], p[:stop]

  def _block(self, index: int) -> tuple[list[str], np.ndarray]:
    cdfs, hexes, effects = self._tables
    rng = np.random.default_rng([self.seed, index, 0x5C17E0])
    n = BLOCK
    # Heavy-tailed counts; I2 is sometimes -1..-3, as in the real files.
    ints = np.floor(np.expm1(rng.normal(1.5, 1.4, (n, CRITEO_NUM_DENSE)).clip(0, 12)))
    ints = ints.astype(np.int64)
    ints[:, 1] = np.where(rng.random(n) < 0.08, -rng.integers(1, 4, n), ints[:, 1])
    dense_empty = rng.random((n, CRITEO_NUM_DENSE)) < np.array(EMPTY_DENSE)
    sparse_empty = rng.random((n, CRITEO_NUM_SPARSE)) < np.array(EMPTY_SPARSE)
    ranks = [np.minimum(np.searchsorted(cdf, rng.random(n)), len(cdf) - 1) for cdf in cdfs]

    # The reader's transform: log1p(max(x, 0)), and 0 for an empty field.
    features = np.where(dense_empty, 0.0, np.log1p(np.maximum(ints, 0)))
    logit = np.full(n, BIAS)
    for i, w in SIGNAL_DENSE.items():
      logit += w * (features[:, i] - 1.5)
    for i in SIGNAL_SPARSE:
      logit += np.where(sparse_empty[:, i], 0.0, effects[i][ranks[i]])
    p = 1.0 / (1.0 + np.exp(-logit))
    labels = (rng.random(n) < p).astype(np.int64)

    columns = [labels.astype(str).astype(object)]
    text = ints.astype(str).astype(object)
    text[dense_empty] = ""
    columns += list(text.T)
    for i in range(CRITEO_NUM_SPARSE):
      col = hexes[i][ranks[i]]
      col[sparse_empty[:, i]] = ""
      columns.append(col)
    rows = np.stack(columns, axis=1).tolist()
    return ["\t".join(r) for r in rows], p

  def write(self, path: str | os.PathLike, num_lines: int, *, compress: bool | None = None
            ) -> None:
    """Writes ``num_lines`` lines to ``path`` (gzip if ``compress``, default: a ``.gz`` name)."""
    path = os.fspath(path)
    compress = path.endswith(".gz") if compress is None else compress
    opener = (lambda p: gzip.open(p, "wt", encoding="ascii", compresslevel=1)) if compress \
        else (lambda p: open(p, "w", encoding="ascii"))
    with opener(path) as f:
      for lines, _ in self.blocks(num_lines):
        f.write("\n".join(lines) + "\n")


def planted_logits(synth: CriteoSynth, num_lines: int) -> np.ndarray:
  """The planted ``logit`` of each of the first ``num_lines`` lines (``[num_lines]``)."""
  ps = [p for _, p in synth.blocks(num_lines)]
  p = np.concatenate(ps) if ps else np.zeros(0)
  return np.log(p) - np.log1p(-p)


def oracle_metrics(synth: CriteoSynth, num_lines: int, labels: np.ndarray) -> dict:
  """AUC and log-loss of the planted probabilities on ``labels`` of the first lines."""
  from embedlib import metrics  # pylint: disable=g-import-not-at-top

  logits = planted_logits(synth, num_lines)
  acc = metrics.StreamingMetrics()
  acc.update(np.asarray(labels, np.float32), logits=logits.astype(np.float32))
  result = acc.result()
  return {"auc": float(result["auc"]), "logloss": float(result["logloss"])}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("path", help="output file (.tsv, or .tsv.gz with --gzip)")
  parser.add_argument("--lines", type=int, required=True, help="number of lines")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--vocab-scale", type=float, default=1.0,
                      help="multiplies each feature's vocabulary (default 1: up to 100k values)")
  parser.add_argument("--gzip", action="store_true", help="gzip the output")
  args = parser.parse_args(argv)
  if args.lines < 0:
    parser.error(f"--lines={args.lines} must be >= 0.")
  if args.gzip and not args.path.endswith(".gz"):
    parser.error(f"--gzip writes gzip data, which CriteoReader reads only from a name "
                 f"ending in .gz; name the output {args.path}.gz.")
  CriteoSynth(args.seed, vocab_scale=args.vocab_scale).write(
      args.path, args.lines, compress=True if args.gzip else None)
  return 0


if __name__ == "__main__":
  sys.exit(main())
