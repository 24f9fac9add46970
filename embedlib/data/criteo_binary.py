"""Criteo as fixed-width binary records: written once from the TSV, read memory-mapped.

    python -m embedlib.data.criteo_binary --in day_0.tsv --out day_0.bin --table-sizes 1000000
    python -m embedlib.data.criteo_binary --in day_0.tsv --out day_0.raw --raw-ids --workers 4

The output is a directory: ``records.bin`` holds one record per valid line,
in line order (the label as float32, the 13 dense features as float32
``log1p(max(x, 0))``, and the 26 ids), and ``meta.json`` says what they are.
The ids are what ``CriteoReader`` yields: int32 rows hashed into the table
sizes given (``--table-sizes``), or with ``--raw-ids`` the int64 values
themselves (``MISSING_RAW`` for a missing one). A batch is then a slice of
the file, so reading costs a copy rather than a parse.

``CriteoBinaryReader`` reads the directory with ``CriteoReader``'s batches,
process shares, hold-out split and state: record ``i`` stands for line
``i`` (converted files have no malformed lines unless ``--max-bad-lines``
let some be skipped, which shifts the hold-out split past them).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Iterator, Sequence

import numpy as np

from embedlib.data import _hashing
from embedlib.data import criteo_format as fmt
from embedlib.data.spec import DataSpec

FORMAT = "embedlib.criteo_binary"
VERSION = 1
_RECORDS, _META = "records.bin", "meta.json"
_BLOCK = 2048  # records turned into columns at once: 320-530 KiB, within a core's cache
_WRITE = "python -m embedlib.data.criteo_binary --in DAY.tsv --out DIR"

log = logging.getLogger(__name__)


def record_dtype(raw_ids: bool) -> np.dtype:
  """One example: ``label`` f4, ``dense`` 13 x f4, ``ids`` 26 x (i4 rows, or i8 raw values)."""
  return np.dtype([("label", "<f4"), ("dense", "<f4", (fmt.CRITEO_NUM_DENSE,)),
                   ("ids", "<i8" if raw_ids else "<i4", (fmt.CRITEO_NUM_SPARSE,))])


def convert(paths: Sequence[str], out: str, *, table_sizes: Sequence[int] | None = None,
            raw_ids: bool = False, workers: int = 0, max_bad_lines: int | None = 0) -> dict:
  """Writes the TSV ``paths`` to the binary directory ``out``; returns its metadata.

  >>> import tempfile
  >>> d = tempfile.mkdtemp()
  >>> line = "\\t".join(["1", "3"] + [""] * 12 + ["a1b2"] * 26) + "\\n"
  >>> _ = open(os.path.join(d, "day.tsv"), "w").write(line * 5)
  >>> convert([os.path.join(d, "day.tsv")], os.path.join(d, "bin"), table_sizes=[1000] * 26)["examples"]
  5
  """
  from embedlib.data import criteo  # pylint: disable=g-import-not-at-top

  if raw_ids == (table_sizes is not None):
    raise ValueError("pass table sizes (ids hashed into them, as the run's config.data."
                     "table_sizes) or raw_ids=True (--raw-ids), not both or neither.")
  sizes = list(table_sizes) if table_sizes is not None else [2] * fmt.CRITEO_NUM_SPARSE
  if len(sizes) == 1:
    sizes = sizes * fmt.CRITEO_NUM_SPARSE
  reader = criteo.CriteoReader(list(paths), criteo.criteo_spec(sizes), batch_size=1,
                               raw_ids=raw_ids, workers=workers, max_bad_lines=max_bad_lines)
  os.makedirs(out, exist_ok=True)
  for name in (_META, _RECORDS):  # an interrupted rewrite must not look like a whole one
    if os.path.exists(os.path.join(out, name)):
      os.remove(os.path.join(out, name))
  dtype, count = record_dtype(raw_ids), 0
  partial = os.path.join(out, _RECORDS + ".partial")
  with open(partial, "wb") as f:
    for chunk in reader.chunks():
      records = np.empty(len(chunk["line"]), dtype)
      records["label"], records["dense"], records["ids"] = (
          chunk["label"], chunk["dense"], chunk["ids"])
      f.write(records.tobytes())
      count += len(records)
  os.replace(partial, os.path.join(out, _RECORDS))
  meta = {"format": FORMAT, "version": VERSION, "examples": count,
          "record_bytes": dtype.itemsize, "ids": "raw" if raw_ids else "hashed",
          "table_sizes": None if raw_ids else sizes,
          "sources": [os.path.abspath(p) for p in paths], "skipped_lines": reader.bad_lines.count}
  with open(os.path.join(out, _META), "w") as f:
    json.dump(meta, f, indent=1)
  return meta


def read_meta(path: str) -> dict:
  """The metadata of binary directory ``path``, checked against its records file.

  Raises:
    FileNotFoundError, NotADirectoryError, CriteoFormatError: naming the
      file, what is wrong, and the command that writes it again.
  """
  if not os.path.exists(path):
    raise FileNotFoundError(f"binary Criteo directory {path!r} does not exist; write it from "
                            f"the TSV with: {_WRITE.replace('DIR', path)}")
  if not os.path.isdir(path):
    raise NotADirectoryError(
        f"{path!r} is a file, and the binary Criteo format is a directory ({_META} and "
        f"{_RECORDS}); for a TSV file use the TSV reader (config.data.format='tsv'), or "
        f"write the directory with: {_WRITE}")
  meta_path, records = os.path.join(path, _META), os.path.join(path, _RECORDS)
  try:
    with open(meta_path) as f:
      meta = json.load(f)
  except FileNotFoundError:
    raise fmt.CriteoFormatError(
        f"{meta_path} is missing: {path} is not a finished binary Criteo directory (its "
        f"conversion was interrupted, or it is another directory); write it with: "
        f"{_WRITE.replace('DIR', path)}") from None
  except (ValueError, UnicodeDecodeError) as e:
    raise fmt.CriteoFormatError(f"{meta_path} is not JSON ({e}); write the directory again "
                                f"with: {_WRITE.replace('DIR', path)}") from None
  if not isinstance(meta, dict) or meta.get("format") != FORMAT:
    raise fmt.CriteoFormatError(f"{meta_path} does not describe a binary Criteo directory "
                                f"(format {FORMAT!r}); write it with: {_WRITE}")
  if meta.get("version") != VERSION:
    raise fmt.CriteoFormatError(
        f"{meta_path}: format version {meta.get('version')!r}, and this embedlib reads "
        f"version {VERSION}; write the directory again from the TSV with this embedlib: "
        f"{_WRITE.replace('DIR', path)}")
  expected = record_dtype(meta["ids"] == "raw").itemsize
  want = meta["examples"] * expected
  have = os.path.getsize(records) if os.path.isfile(records) else None
  if meta.get("record_bytes") != expected or have != want:
    found = "is missing" if have is None else f"holds {have:,} bytes"
    raise fmt.CriteoFormatError(
        f"{records} {found}, and {_META} says {meta['examples']:,} records of {expected} "
        f"bytes ({want:,} bytes): the file is truncated or from another conversion; write "
        f"the directory again with: {_WRITE.replace('DIR', path)}")
  return meta


class CriteoBinaryReader(Iterator[dict]):
  """``CriteoReader``'s batches from a binary directory, memory-mapped.

  >>> import tempfile
  >>> d = tempfile.mkdtemp()
  >>> line = "\\t".join(["1", "3"] + [""] * 12 + ["a1b2"] * 26) + "\\n"
  >>> _ = open(os.path.join(d, "day.tsv"), "w").write(line * 5)
  >>> _ = convert([os.path.join(d, "day.tsv")], os.path.join(d, "bin"), raw_ids=True)
  >>> reader = CriteoBinaryReader(os.path.join(d, "bin"), batch_size=2, raw_ids=True)
  >>> [b["label"].tolist() for b in reader], reader.dropped_examples
  ([[1.0, 1.0], [1.0, 1.0]], 1)

  Args:
    path: a directory written by ``convert`` (``python -m embedlib.data.criteo_binary``).
    spec: table sizes, from ``criteo_spec``: with hashed ids they must be
      the sizes the directory was written with.
    batch_size: as ``CriteoReader``'s, and so are ``process_index``,
      ``process_count``, ``num_epochs``, ``holdout``, ``split`` and
      ``raw_ids``. Raw ids need a directory written with ``--raw-ids``;
      hashed ids from such a directory are hashed while reading (slower
      than a directory of hashed ids).

  Raises:
    FileNotFoundError: no directory or no ``meta.json`` there (``read_meta``).
    NotADirectoryError: ``path`` is a file (``read_meta``).
    CriteoFormatError: a ``meta.json`` or records file that can't be read
      (``read_meta``).
    ValueError: a spec or ``raw_ids`` that the directory can't give.
  """

  def __init__(self, path: str | os.PathLike, spec: DataSpec | None = None, *, batch_size: int,
               process_index: int = 0, process_count: int = 1, num_epochs: int | None = 1,
               holdout: float = 0.0, split: str = "train", raw_ids: bool = False):
    from embedlib.data import criteo  # pylint: disable=g-import-not-at-top

    self.path = os.fspath(path)
    meta = read_meta(self.path)
    spec = criteo.criteo_spec() if spec is None else spec
    sizes = [f.num_embeddings for f in spec.features]
    stored_raw = meta["ids"] == "raw"
    if raw_ids and not stored_raw:
      raise ValueError(
          f"{self.path} holds hashed ids, not raw ones; write it with --raw-ids for "
          "config.data.raw_ids=True, or read it with raw_ids=False.")
    if not stored_raw and meta["table_sizes"] != sizes:
      raise ValueError(
          f"{self.path} holds ids hashed into table sizes {_short(meta['table_sizes'])}, and "
          f"the run's are {_short(sizes)}: set config.data.table_sizes to the directory's, or "
          f"write it again with --table-sizes {','.join(map(str, sizes))} (or --raw-ids).")
    if not 0 <= process_index < process_count or batch_size < 1 or batch_size % process_count:
      raise ValueError(f"batch_size={batch_size} must be a positive multiple of process_count="
                       f"{process_count}, and process_index={process_index} lie in "
                       f"[0, {process_count}).")
    if not 0.0 <= holdout < 1.0 or split not in ("train", "holdout") or (
        split == "holdout" and not holdout):
      raise ValueError(f"holdout={holdout!r}, split={split!r}: pass a holdout fraction in "
                       "(0, 1) with split='holdout', or split='train'.")
    self.spec, self.raw_ids, self.meta = spec, bool(raw_ids), meta
    self.batch_size, self.local_batch_size = batch_size, batch_size // process_count
    self.process_index, self.process_count = process_index, process_count
    self.num_epochs = num_epochs
    self._hash = None
    if stored_raw and not raw_ids:
      salts = [_hashing.derive_key("criteo", f.name) for f in spec.features]
      self._hash = (np.array(salts, np.uint64), np.array([n - 1 for n in sizes], np.uint64))
    count = meta["examples"]
    self._records = np.memmap(os.path.join(self.path, _RECORDS), record_dtype(stored_raw),
                              mode="r", shape=(count,)) if count else np.empty(0, record_dtype(stored_raw))
    below = int(round(holdout * fmt.HOLDOUT_BUCKETS))
    self._kept = None
    if below:  # the split's record numbers, found in blocks to bound the memory
      self._kept = np.concatenate([np.empty(0, np.int64)] + [
          np.flatnonzero(fmt.in_split(np.arange(s, min(s + (1 << 22), count)), below, split)) + s
          for s in range(0, count, 1 << 22)])
    kept = count if self._kept is None else len(self._kept)
    self.batches_per_epoch = kept // batch_size
    tail = np.arange(self.batches_per_epoch * batch_size, kept)
    self._dropped_per_epoch = int(np.sum(tail % process_count == process_index))
    self.dropped_examples = 0
    self._position = 0

  @property
  def position(self) -> int:
    """Number of batches yielded so far (across epochs)."""
    return self._position

  def get_state(self) -> dict:
    """``{"position", "epoch", "line"}`` (the record the next batch starts at)."""
    epoch, k = divmod(self._position, max(self.batches_per_epoch, 1))
    start = k * self.batch_size
    line = start if self._kept is None or start >= len(self._kept) else int(self._kept[start])
    return {"position": self._position, "epoch": epoch, "line": line}

  def set_state(self, state: dict) -> None:
    """Resumes from ``get_state()`` (its position decides)."""
    self._position = int(state["position"])
    self.dropped_examples = self._dropped_per_epoch * (
        self._position // max(self.batches_per_epoch, 1))

  def close(self) -> None:
    """Nothing to stop (``CriteoReader``'s interface)."""

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    if not self.batches_per_epoch:
      if self.num_epochs == 0:
        raise StopIteration
      raise fmt.CriteoFormatError(
          f"{self.path} holds fewer than batch_size={self.batch_size} records of this split; "
          "use a smaller batch_size or more data.")
    epoch, k = divmod(self._position, self.batches_per_epoch)
    if self.num_epochs is not None and epoch >= self.num_epochs:
      raise StopIteration
    lo, hi = k * self.batch_size + self.process_index, (k + 1) * self.batch_size
    if self._kept is None:
      records = self._records[lo:hi:self.process_count]
    else:
      records = self._records[self._kept[lo:hi:self.process_count]]
    if k + 1 == self.batches_per_epoch:
      self.dropped_examples += self._dropped_per_epoch
    self._position += 1
    n = len(records)
    label, dense = np.empty(n, np.float32), np.empty((n, fmt.CRITEO_NUM_DENSE), np.float32)
    ids = np.empty((fmt.CRITEO_NUM_SPARSE, n), np.int64 if self.raw_ids else np.int32)
    # Block by block: a block's records stay in cache while their ids are
    # turned into columns (whole-batch columns would each read every record).
    for lo in range(0, n, _BLOCK):
      block = records[lo:lo + _BLOCK]
      label[lo:lo + _BLOCK], dense[lo:lo + _BLOCK] = block["label"], block["dense"]
      values = block["ids"]
      if self._hash is not None:
        values = fmt.to_ids(np.where(values == fmt.MISSING_RAW, -1, values), *self._hash,
                            raw_ids=False)
      ids[:, lo:lo + _BLOCK] = values.T
    return {"dense": dense, "sparse": {f.name: ids[i] for i, f in enumerate(self.spec.features)},
            "label": label}


def _short(sizes) -> str:
  return f"[{sizes[0]}] * 26" if sizes and len(set(sizes)) == 1 else str(sizes)


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m embedlib.data.criteo_binary",
      description="Writes Criteo TSV files (plain or .gz) as a binary directory read by "
                  "CriteoBinaryReader (config.data.format='binary').")
  parser.add_argument("--in", dest="paths", action="append", required=True,
                      help="a Criteo TSV file; repeat for several, read in order")
  parser.add_argument("--out", required=True, help="the directory to write")
  kind = parser.add_mutually_exclusive_group(required=True)
  kind.add_argument("--table-sizes", help="rows per table: one number, or 26 comma-separated "
                    "(the run's config.data.table_sizes)")
  kind.add_argument("--raw-ids", action="store_true", help="keep the 64-bit values (dynamic "
                    "tables, config.data.raw_ids=True)")
  parser.add_argument("--workers", type=int, default=0,
                      help="parse in this many processes (plain TSV only)")
  parser.add_argument("--max-bad-lines", type=int, default=0,
                      help="malformed lines to skip before stopping; -1 skips them all")
  args = parser.parse_args(argv)
  sizes = None if args.raw_ids else [int(s) for s in args.table_sizes.split(",")]
  try:
    meta = convert(args.paths, args.out, table_sizes=sizes, raw_ids=args.raw_ids,
                   workers=args.workers,
                   max_bad_lines=None if args.max_bad_lines == -1 else args.max_bad_lines)
  except (OSError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  print(f"wrote {meta['examples']:,} records ({meta['ids']} ids) to {args.out}"
        + (f"; skipped {meta['skipped_lines']} malformed lines" if meta["skipped_lines"] else ""))
  return 0


if __name__ == "__main__":
  sys.exit(main())
