"""Dataset layout and the batch format every embedlib data source yields.

The batch format (the one place it is documented)
--------------------------------------------------
A batch is a plain dict of numpy arrays, holding this process's rows only
(``local_batch_size = batch_size // process_count``)::

    {
        "dense":  float32 [B, num_dense],
        "sparse": {feature_name: int32 [B]          (bag_size == 1, single-hot)
                                 int32 [B, bag_size] (bag_size > 1, multi-hot)},
        "label":  float32 [B]   (0.0 or 1.0),
    }

Multi-hot bags are padded on the right with ``PAD_ID`` (-1); every other id
lies in ``[0, num_embeddings)``. Ids are int32 whatever the table size (and
whether or not jax runs with x64), so a table has at most ``MAX_ROWS`` =
2**31 rows; the sources reduce raw ids (hashed 64-bit values) into the
table before they leave the source. The dict's structure and shapes are the same
for every batch of a source, so a jitted step never retraces. Feature order in
``"sparse"`` follows ``DataSpec.features``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

#: Id that pads a multi-hot bag to its fixed ``bag_size``; looked up as nothing.
PAD_ID = -1
#: Most rows a table may have: its largest id, MAX_ROWS - 1, is int32's largest.
MAX_ROWS = 2**31


@dataclasses.dataclass(frozen=True)
class SparseFeature:
  """One categorical feature: its name, table size and bag size.

  >>> SparseFeature("user", 1000).bag_size
  1
  >>> SparseFeature("tags", 50, bag_size=4)
  SparseFeature(name='tags', num_embeddings=50, bag_size=4)

  Attributes:
    name: key of the feature in ``batch["sparse"]``.
    num_embeddings: rows of its table; ids lie in ``[0, num_embeddings)``.
    bag_size: 1 for single-hot ``[B]`` ids, > 1 for multi-hot ``[B, bag_size]``
      ids right-padded with ``PAD_ID``.
  """

  name: str
  num_embeddings: int
  bag_size: int = 1

  def __post_init__(self):
    if not isinstance(self.name, str) or not self.name:
      raise ValueError(f"SparseFeature name must be a non-empty str, got {self.name!r}.")
    for field in ("num_embeddings", "bag_size"):
      value = getattr(self, field)
      if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise ValueError(
            f"SparseFeature {self.name!r}: {field} must be an int >= 1, got {value!r}."
        )
    if self.num_embeddings > MAX_ROWS:
      raise ValueError(
          f"SparseFeature {self.name!r}: num_embeddings={self.num_embeddings} is more rows "
          f"than int32 ids can address (at most {MAX_ROWS}); hash the feature into "
          f"{MAX_ROWS} rows or fewer.")


@dataclasses.dataclass(frozen=True)
class DataSpec:
  """Layout of a dataset: how many dense features, which categorical ones.

  >>> spec = DataSpec(2, (SparseFeature("a", 10), SparseFeature("b", 5, bag_size=3)))
  >>> spec.feature_names
  ('a', 'b')
  >>> {k: v.shape for k, v in spec.zeros(4)["sparse"].items()}
  {'a': (4,), 'b': (4, 3)}

  Attributes:
    num_dense: width of ``batch["dense"]``.
    features: the categorical features, in batch order; names are unique.
  """

  num_dense: int
  features: tuple[SparseFeature, ...]

  def __post_init__(self):
    if not isinstance(self.num_dense, (int, np.integer)) or self.num_dense < 0:
      raise ValueError(f"DataSpec num_dense must be an int >= 0, got {self.num_dense!r}.")
    features = tuple(self.features)
    object.__setattr__(self, "features", features)
    for f in features:
      if not isinstance(f, SparseFeature):
        raise TypeError(
            f"DataSpec features must be SparseFeature(name, num_embeddings, bag_size=1), "
            f"got {f!r}."
        )
    names = [f.name for f in features]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
      raise ValueError(f"DataSpec feature names must be unique; repeated: {duplicates}.")

  @classmethod
  def from_sizes(
      cls,
      num_dense: int,
      num_embeddings: Sequence[int],
      *,
      bag_sizes: Sequence[int] | None = None,
      prefix: str = "f",
  ) -> DataSpec:
    """A spec with features named ``{prefix}0, {prefix}1, ...``.

    >>> DataSpec.from_sizes(3, [100, 20], bag_sizes=[1, 4]).features[1]
    SparseFeature(name='f1', num_embeddings=20, bag_size=4)

    Args:
      num_dense: width of ``batch["dense"]``.
      num_embeddings: table size of each feature.
      bag_sizes: bag size of each feature (default all 1).
      prefix: name prefix.

    Returns:
      The spec.
    """
    bag_sizes = [1] * len(num_embeddings) if bag_sizes is None else list(bag_sizes)
    if len(bag_sizes) != len(num_embeddings):
      raise ValueError(
          f"bag_sizes has {len(bag_sizes)} entries but num_embeddings has "
          f"{len(num_embeddings)}; give one bag size per feature."
      )
    return cls(
        num_dense,
        tuple(
            SparseFeature(f"{prefix}{i}", int(n), int(b))
            for i, (n, b) in enumerate(zip(num_embeddings, bag_sizes))
        ),
    )

  @property
  def feature_names(self) -> tuple[str, ...]:
    return tuple(f.name for f in self.features)

  def zeros(self, batch_size: int) -> dict:
    """An all-zero batch of ``batch_size`` rows (ids 0, bags all ``PAD_ID``).

    >>> DataSpec.from_sizes(1, [7]).zeros(2)["dense"].shape
    (2, 1)

    Args:
      batch_size: rows ``B``.

    Returns:
      A batch dict in the module's format; useful to initialise a model.
    """
    sparse = {}
    for f in self.features:
      if f.bag_size == 1:
        sparse[f.name] = np.zeros((batch_size,), np.int32)
      else:
        sparse[f.name] = np.full((batch_size, f.bag_size), PAD_ID, np.int32)
    return {
        "dense": np.zeros((batch_size, self.num_dense), np.float32),
        "sparse": sparse,
        "label": np.zeros((batch_size,), np.float32),
    }

  def check_batch(self, batch: Mapping, batch_size: int | None = None) -> None:
    """Raises ValueError naming the first key, shape, dtype or id out of spec.

    >>> spec = DataSpec.from_sizes(1, [7])
    >>> spec.check_batch(spec.zeros(2), batch_size=2)
    >>> bad = spec.zeros(2); bad["sparse"]["f0"][0] = 7
    >>> spec.check_batch(bad)
    Traceback (most recent call last):
    ...
    ValueError: batch["sparse"]["f0"] has id 7 outside [0, 7) ...

    Args:
      batch: a batch dict.
      batch_size: expected rows, or None to take them from ``batch["label"]``.
    """
    missing = {"dense", "sparse", "label"} - set(batch)
    if missing:
      raise ValueError(f"batch lacks keys {sorted(missing)}; see embedlib.data.spec.")
    b = len(batch["label"]) if batch_size is None else batch_size
    _check_array('batch["label"]', batch["label"], (b,), np.float32)
    _check_array('batch["dense"]', batch["dense"], (b, self.num_dense), np.float32)
    names = set(batch["sparse"])
    if names != set(self.feature_names):
      raise ValueError(
          f'batch["sparse"] has features {sorted(names)}, the spec has '
          f"{sorted(self.feature_names)}."
      )
    for f in self.features:
      ids = batch["sparse"][f.name]
      what = f'batch["sparse"]["{f.name}"]'
      _check_array(what, ids, (b,) if f.bag_size == 1 else (b, f.bag_size), np.int32)
      low = PAD_ID if f.bag_size > 1 else 0
      bad = ids[(ids < low) | (ids >= f.num_embeddings)]
      if bad.size:
        raise ValueError(
            f"{what} has id {int(bad[0])} outside [{max(low, 0)}, {f.num_embeddings}) "
            f"(table size num_embeddings={f.num_embeddings}); hash or clip ids into the table."
        )


def _check_array(what, array, shape, dtype):
  if not isinstance(array, np.ndarray) or array.shape != shape or array.dtype != dtype:
    got = (
        f"{array.dtype}{list(array.shape)}" if isinstance(array, np.ndarray) else type(array)
    )
    raise ValueError(f"{what} must be a numpy {np.dtype(dtype)}{list(shape)}, got {got}.")
