"""Planted synthetic click data: the default data of the quickstart.

Every example is a pure function of ``(seed, split, example index)``, computed
with a stable counter-based hash (no sequential RNG state), so that:

* a batch can be produced from its number alone: resuming is ``position = n``;
* each process computes only its own rows, and N processes together produce
  exactly the batches one process would;
* train and eval streams (``split``) are independent but share one hidden
  model, which depends on ``seed`` only.

The hidden model
----------------
Categorical ids are drawn with Zipf popularity (``P(rank k) ~ k**-s``) over a
raw id space of ``raw_vocab_size`` ids per feature, then hashed into the
feature's ``num_embeddings`` rows. The label is ``Bernoulli(sigmoid(logit))``::

    logit = BIAS + signal_scale * (
        CAT_SCALE   * sum_f w_f[row_f] / sqrt(F)         # one weight per table row
      + DENSE_SCALE * dense @ beta / sqrt(num_dense)     # dense ~ N(0, 1)
      + PAIR_SCALE  * <u[row_0], v[row_1]> / sqrt(PAIR_DIM))   # f0 x f1 interaction

with ``w``, ``beta``, ``u``, ``v`` standard normal; a multi-hot feature
contributes the mean weight of its bag (1..bag_size ids, uniform length). The
weights live on table *rows* (after hashing), so the oracle is achievable by a
model with exactly these tables; what stays out of reach is the finite-sample
noise on rarely seen rows. ``oracle_metrics`` computes the oracle's exact AUC
and log-loss on the same examples a model is evaluated on.

With 8 dense and 8 single-hot tables of 1,000 rows (s = 1.1), the oracle AUC
is 0.81 at seed 0 and 0.78-0.81 over seeds (the weights of the few most
popular rows vary with the seed); the click rate is 0.23-0.31.
"""

from __future__ import annotations

import math

import numpy as np

from embedlib.data import _hashing
from embedlib.data.planted_stream import PlantedStream
from embedlib.data.spec import PAD_ID, DataSpec

BIAS = -1.3
CAT_SCALE = 1.0
DENSE_SCALE = 0.6
PAIR_SCALE = 0.6
PAIR_DIM = 4
#: Planted row weights are tabulated (8 bytes a row) for the first features
#: whose rows add up to at most this; larger tables hash them per lookup.
_TABULATE_ROWS = 1 << 23


class SyntheticSource(PlantedStream):
  """Deterministic, resumable, per-process stream of planted click batches.

  >>> spec = DataSpec.from_sizes(2, [100, 50], bag_sizes=[1, 3])
  >>> src = SyntheticSource(spec, batch_size=8, seed=0)
  >>> batch = next(src)
  >>> batch["dense"].shape, batch["sparse"]["f1"].shape, src.position
  ((8, 2), (8, 3), 1)
  >>> src.position = 0; bool((next(src)["label"] == batch["label"]).all())
  True

  Args:
    spec: the dataset layout.
    batch_size: global batch size; each process yields
      ``batch_size // process_count`` rows.
    seed: selects the hidden model and the streams.
    split: stream name; ``"train"`` and ``"eval"`` draw different examples
      from the same hidden model.
    zipf_exponent: popularity exponent ``s`` of the raw ids (1.05-1.2 is
      realistic; larger is more skewed).
    raw_vocab_size: raw ids per feature before hashing, default ten times the
      feature's ``num_embeddings``.
    signal_scale: multiplies the non-bias logit; below 1 makes the problem
      harder (oracle AUC nearer 0.5), above 1 easier.
    process_index: this process's index in ``[0, process_count)``.
    process_count: number of processes sharing each global batch.
    num_batches: stop after this many batches (e.g. an eval set), or None for
      an endless stream.
  """

  def __init__(
      self,
      spec: DataSpec,
      *,
      batch_size: int,
      seed: int = 0,
      split: str = "train",
      zipf_exponent: float = 1.1,
      raw_vocab_size: int | None = None,
      signal_scale: float = 1.0,
      process_index: int = 0,
      process_count: int = 1,
      num_batches: int | None = None,
  ):
    super().__init__(batch_size=batch_size, process_index=process_index,
                     process_count=process_count, num_batches=num_batches)
    if zipf_exponent <= 0:
      raise ValueError(f"zipf_exponent must be > 0, got {zipf_exponent}.")
    if raw_vocab_size is not None and raw_vocab_size < 1:
      raise ValueError(f"raw_vocab_size must be >= 1 or None, got {raw_vocab_size}.")
    self.spec = spec
    self.seed, self.split = seed, split
    self.zipf_exponent = float(zipf_exponent)
    self.signal_scale = float(signal_scale)

    model = _hashing.derive_key(seed, "model")
    stream = _hashing.derive_key(seed, "stream", split)
    features = spec.features
    self._vocab = np.array(
        [raw_vocab_size or 10 * f.num_embeddings for f in features], np.float64
    )
    self._rows = np.array([f.num_embeddings for f in features], np.uint64)
    # Per-feature keys: which raw id an example draws, how a raw id hashes to a
    # row, a row's planted weight, and a bag's length.
    self._id_keys = _keys(stream, "id", len(features))
    self._salts = _keys(model, "salt", len(features))
    self._weight_keys = _keys(model, "weight", len(features))
    self._len_keys = _keys(stream, "bag_len", len(features))
    self._dense_keys = _keys(stream, "dense", spec.num_dense)
    self._label_key = _hashing.derive_key(stream, "label")
    self._pair_keys = _keys(model, "pair", 2 * PAIR_DIM)
    beta_bits = _hashing.hash_u64(_hashing.derive_key(model, "beta"), _arange(spec.num_dense))
    self._beta = _hashing.normal(beta_bits)
    self._single = [i for i, f in enumerate(features) if f.bag_size == 1]
    # Box-Muller per lookup dominates generation time; a table per feature
    # makes it a gather. Both give bit-identical weights.
    self._weight_tables, budget = [], _TABULATE_ROWS
    for i, f in enumerate(features):
      tabulate = f.num_embeddings <= budget
      budget -= f.num_embeddings if tabulate else 0
      self._weight_tables.append(
          self._row_weights(i, _arange(f.num_embeddings)) if tabulate else None
      )

  # -- the oracle ------------------------------------------------------------

  def oracle_metrics(self, num_batches: int | None = None, start: int = 0) -> dict:
    """Exact AUC and log-loss of the hidden model on global batches ``start, ...``.

    These are the best any model can score on the same examples (up to the
    labels' sampling noise, which both face). Every process gets the same
    numbers: it recomputes all processes' rows.

    >>> spec = DataSpec.from_sizes(8, [1000] * 8)
    >>> m = SyntheticSource(spec, batch_size=4096, split="eval").oracle_metrics(4)
    >>> m["count"], round(m["auc"], 1)
    (16384, 0.8)

    Args:
      num_batches: how many global batches; default ``self.num_batches``.
      start: first global batch.

    Returns:
      ``{"auc": float, "logloss": float, "count": int}``.
    """
    from embedlib import metrics  # pylint: disable=g-import-not-at-top

    acc = metrics.StreamingMetrics()
    for batch, logits in self.with_truth(num_batches, start):
      acc.update(batch["label"], logits=logits)
    return acc.result()

  def oracle_auc(self, num_batches: int | None = None, start: int = 0) -> float:
    """``oracle_metrics(...)["auc"]``.

    >>> SyntheticSource(DataSpec.from_sizes(2, [50]), batch_size=64).oracle_auc(2) > 0.5
    True
    """
    return self.oracle_metrics(num_batches, start)["auc"]

  # -- generation -------------------------------------------------------------

  def _generate(self, start: int, count: int) -> tuple[dict, np.ndarray]:
    """Examples ``start .. start + count - 1``: the batch and its true logits."""
    spec = self.spec
    example = np.arange(start, start + count, dtype=np.uint64)
    sparse, cat = {}, np.zeros(count)
    row_of = {}
    if self._single:
      idx = self._single
      rows = self._draw_rows(example[:, None], np.asarray(idx))  # [B, F1]
      for j, i in enumerate(idx):
        cat += self._row_weights(i, rows[:, j])
      for j, i in enumerate(idx):
        row_of[i] = rows[:, j]
        sparse[spec.features[i].name] = rows[:, j].astype(np.int32)
    for i, f in enumerate(spec.features):
      if f.bag_size == 1:
        continue
      slots = example[:, None] * np.uint64(f.bag_size) + _arange(f.bag_size)
      rows = self._draw_rows(slots, np.asarray(i))  # [B, L]
      length_bits = _hashing.hash_u64(self._len_keys[i], example)
      length = 1 + (length_bits % np.uint64(f.bag_size)).astype(np.int64)
      present = np.arange(f.bag_size) < length[:, None]
      cat += (self._row_weights(i, rows) * present).sum(axis=1) / length
      row_of[i] = rows[:, 0]
      sparse[f.name] = np.where(present, rows.astype(np.int32), np.int32(PAD_ID))
    signal = CAT_SCALE * cat / math.sqrt(max(len(spec.features), 1))

    dense = _hashing.normal(_hashing.hash_u64(self._dense_keys, example[:, None]))
    if spec.num_dense:
      signal += DENSE_SCALE * (dense @ self._beta) / math.sqrt(spec.num_dense)
    if len(spec.features) >= 2:
      # The interaction uses the first id of each bag of features 0 and 1, a
      # pattern a dot-interaction model (DLRM) can represent.
      u = _hashing.normal(_hashing.hash_u64(self._pair_keys[:PAIR_DIM], row_of[0][:, None]))
      v = _hashing.normal(_hashing.hash_u64(self._pair_keys[PAIR_DIM:], row_of[1][:, None]))
      signal += PAIR_SCALE * (u * v).sum(axis=1) / math.sqrt(PAIR_DIM)
    logits = BIAS + self.signal_scale * signal
    coin = _hashing.uniform(_hashing.hash_u64(self._label_key, example))
    label = (coin < 1.0 / (1.0 + np.exp(-logits))).astype(np.float32)
    batch = {"dense": dense.astype(np.float32), "sparse": sparse, "label": label}
    return batch, logits

  def _row_weights(self, feature: int, rows: np.ndarray) -> np.ndarray:
    """Planted weights ``w_feature[rows]``, float64 of the shape of ``rows``."""
    table = self._weight_tables[feature] if len(self._weight_tables) > feature else None
    if table is not None:
      return table[rows]
    return _hashing.normal(_hashing.hash_u64(self._weight_keys[feature], rows))

  def _draw_rows(self, counter: np.ndarray, features: np.ndarray) -> np.ndarray:
    """Zipf-popular raw ids hashed to table rows, uint64 of the broadcast shape."""
    u = _hashing.uniform(_hashing.hash_u64(self._id_keys[features], counter))
    vocab = self._vocab[features]
    # Inverse CDF of the continuous power law on [1, V + 1); its floor is a
    # Zipf-like rank with P(k) ~ k**-s, computed in closed form (no tables).
    s = self.zipf_exponent
    if abs(s - 1.0) < 1e-9:
      x = np.power(vocab + 1.0, u)
    else:
      top = np.power(vocab + 1.0, 1.0 - s)
      x = np.power(1.0 + u * (top - 1.0), 1.0 / (1.0 - s))
    rank = np.minimum(x.astype(np.uint64) - np.uint64(1), vocab.astype(np.uint64) - np.uint64(1))
    return _hashing.mix(rank ^ self._salts[features]) % self._rows[features]


def _keys(parent: int, name: str, n: int) -> np.ndarray:
  return np.array([_hashing.derive_key(parent, name, i) for i in range(n)], np.uint64)


def _arange(n: int) -> np.ndarray:
  return np.arange(n, dtype=np.uint64)
