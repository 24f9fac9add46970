"""CriteoReader on small TSV files: values, hashing, bad lines, slices, resume."""

import gzip
import logging
import os
import subprocess
import sys

import numpy as np
import pytest

from embedlib.data import CriteoReader, criteo_spec
from embedlib.data import criteo_chunks
from embedlib.data.criteo import CriteoFormatError

SPEC = criteo_spec([100] * 13 + [2] + [1000] * 12)


def make_line(label="1", ints=None, cats=None):
  ints = [""] * 13 if ints is None else [str(v) for v in ints]
  cats = [f"{i:08x}" for i in range(26)] if cats is None else cats
  return "\t".join([label, *ints, *cats]) + "\n"


def numbered_lines(n):
  """Line i has I1 = i and label i % 2, so rows can be traced back to lines."""
  return [make_line(str(i % 2), [i] + [""] * 12, [f"{i * 7919:x}"] + [""] * 25) for i in range(n)]


def write(tmp_path, lines, name="data.tsv"):
  path = tmp_path / name
  data = "".join(lines).encode()
  if name.endswith(".gz"):
    data = gzip.compress(data)
  path.write_bytes(data)
  return str(path)


def line_ids(batch):
  return np.rint(np.expm1(batch["dense"][:, 0])).astype(int)


def test_values_missing_fields_and_transforms(tmp_path):
  lines = [
      make_line("1", [5, -3, ""] + [0] * 10, ["68fd1e64", ""] + ["0"] * 24),
      make_line("0", [0] * 13, ["68FD1E64", "a"] + ["0"] * 24).replace("\n", "\r\n"),
  ]
  batch = next(CriteoReader(write(tmp_path, lines), SPEC, batch_size=2))
  SPEC.check_batch(batch, batch_size=2)
  np.testing.assert_array_equal(batch["label"], [1.0, 0.0])
  np.testing.assert_allclose(batch["dense"][0, :3], [np.log1p(5), 0.0, 0.0], rtol=1e-6)
  c1, c2 = batch["sparse"]["C1"], batch["sparse"]["C2"]
  assert c1[0] == c1[1] != 0  # hex is case-insensitive
  assert c2[0] == 0 and c2[1] != 0  # row 0 is "missing"
  assert (batch["sparse"]["C14"] == 1).all()  # a 2-row table: the only non-missing row


def test_hashing_spreads_values_and_is_stable_across_processes(tmp_path):
  lines = [make_line(cats=[f"{i:x}"] * 26) for i in range(512)]
  path = write(tmp_path, lines)
  ids = next(CriteoReader(path, SPEC, batch_size=512))["sparse"]
  assert (ids["C20"] >= 1).all() and (ids["C20"] < 1000).all()
  assert len(np.unique(ids["C20"])) > 350  # 512 values into 999 rows
  assert not np.array_equal(ids["C20"], ids["C21"])  # per-feature salt
  code = (
      "import sys; from embedlib.data import CriteoReader, criteo_spec; "
      f"b = next(CriteoReader({path!r}, criteo_spec(1000), batch_size=512)); "
      "print(b['sparse']['C20'].tolist())"
  )
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env = dict(os.environ, PYTHONHASHSEED="12345", JAX_PLATFORMS="cpu")
  out = subprocess.run(
      [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, check=True
  )
  assert out.stdout.strip() == str(ids["C20"].tolist())


BAD_LINES = {
    "fields": ("1\t2\t3\n", "expected 40 tab-separated fields, got 3"),
    "label": (make_line(label="2"), "label must be 0 or 1, got '2'"),
    "label_text": (make_line(label="yes"), "label must be 0 or 1"),
    "integer": (make_line(ints=["1.5"] + [""] * 12),
                "integer feature I1 is not an integer .*: '1.5'"),
    "integer_underscore": (make_line(ints=["1_000"] + [""] * 12),
                           "integer feature I1 is not an integer .*: '1_000'"),
    "integer_spaces": (make_line(ints=[""] * 12 + [" 7 "]), "integer feature I13 .*: ' 7 '"),
    "integer_plus": (make_line(ints=["+3"] + [""] * 12), "integer feature I1 .*: '\\+3'"),
    "integer_exponent": (make_line(ints=["1e3"] + [""] * 12), "integer feature I1 .*: '1e3'"),
    "hex": (make_line(cats=["zz"] + [""] * 25), "categorical feature C1 is not hex: 'zz'"),
    "hex_sign": (make_line(cats=[""] * 25 + ["-1f"]), "categorical feature C26 is not a hex string"),
    "not_ascii": ("1" + "\t" * 39 + "\xe9\n", "not ASCII"),
}


@pytest.mark.parametrize("kind", BAD_LINES)
def test_malformed_line_stops_with_file_line_and_reason(tmp_path, kind):
  bad, reason = BAD_LINES[kind]
  path = write(tmp_path, [make_line(), make_line(), bad, make_line()])
  with pytest.raises(CriteoFormatError, match="data.tsv:3: " + reason.replace("(", "\\(")) as info:
    list(CriteoReader(path, SPEC, batch_size=1))
  assert "max_bad_lines" in str(info.value)


def test_skipped_lines_are_counted_with_their_numbers(tmp_path):
  good = numbered_lines(6)
  lines = good[:2] + [BAD_LINES["label"][0]] + good[2:4] + [BAD_LINES["fields"][0]] + good[4:]
  path = write(tmp_path, lines)
  reader = CriteoReader(path, SPEC, batch_size=3, max_bad_lines=None)
  batches = list(reader)
  assert [line_ids(b).tolist() for b in batches] == [[0, 1, 2], [3, 4, 5]]
  assert reader.bad_lines.count == 2
  assert [n for _, n, _ in reader.bad_lines.first] == [3, 6]
  assert "2 malformed line(s)" in str(reader.bad_lines)
  with pytest.raises(CriteoFormatError, match="data.tsv:6: .*malformed so far: 2"):
    list(CriteoReader(path, SPEC, batch_size=3, max_bad_lines=1))


def test_missing_path_fails_at_construction_naming_it(tmp_path):
  missing = str(tmp_path / "nope.tsv.gz")
  with pytest.raises(FileNotFoundError, match="nope.tsv.gz"):
    CriteoReader([write(tmp_path, numbered_lines(2)), missing], SPEC, batch_size=1)


def test_a_directory_is_called_a_directory(tmp_path):
  with pytest.raises(IsADirectoryError, match=f"{tmp_path}' is a directory; pass the path of a"):
    CriteoReader(str(tmp_path), SPEC, batch_size=1)


def test_gzip_equals_plain_and_files_concatenate(tmp_path):
  lines = numbered_lines(10)
  plain = [b["dense"] for b in CriteoReader(write(tmp_path, lines), SPEC, batch_size=5)]
  parts = [write(tmp_path, lines[:4], "a.tsv.gz"), write(tmp_path, lines[4:], "b.tsv")]
  split = [b["dense"] for b in CriteoReader(parts, SPEC, batch_size=5)]
  np.testing.assert_array_equal(np.stack(plain), np.stack(split))


@pytest.mark.parametrize("process_count", [2, 3])
def test_process_shares_together_hold_the_one_process_batches(tmp_path, process_count):
  path = write(tmp_path, numbered_lines(24))
  batch_size = 6
  whole = [line_ids(b) for b in CriteoReader(path, SPEC, batch_size=batch_size)]
  shares = [
      [
          line_ids(b)
          for b in CriteoReader(
              path, SPEC, batch_size=batch_size, process_index=p, process_count=process_count
          )
      ]
      for p in range(process_count)
  ]
  assert all(len(s) == len(whole) == 4 for s in shares)
  for k, expected in enumerate(whole):
    together = np.concatenate([s[k] for s in shares])
    assert sorted(together.tolist()) == expected.tolist()
    assert all(len(s[k]) == batch_size // process_count for s in shares)


@pytest.mark.parametrize("state_kind", ["full", "position_only"])
def test_resume_continues_at_the_next_batch_across_epochs(tmp_path, state_kind):
  path = write(tmp_path, numbered_lines(11))  # 11 = 3 batches of 3 + 2 dropped
  reader = CriteoReader(path, SPEC, batch_size=3, num_epochs=2)
  first = [line_ids(next(reader)) for _ in range(4)]
  state = reader.get_state()
  rest = [line_ids(b) for b in reader]
  assert [b.tolist() for b in first + rest] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]] * 2
  assert reader.dropped_examples == 4
  resumed = CriteoReader(path, SPEC, batch_size=3, num_epochs=2)
  resumed.set_state(state if state_kind == "full" else {"position": state["position"]})
  assert [line_ids(b).tolist() for b in resumed] == [b.tolist() for b in rest]
  assert resumed.position == 6


def test_endless_reader_needs_one_full_batch(tmp_path):
  reader = CriteoReader(write(tmp_path, numbered_lines(2)), SPEC, batch_size=4, num_epochs=None)
  with pytest.raises(CriteoFormatError, match="fewer than batch_size"):
    next(reader)


def test_spec_must_have_the_criteo_layout(tmp_path):
  with pytest.raises(ValueError, match="criteo_spec"):
    CriteoReader(write(tmp_path, numbered_lines(2)), criteo_spec([1] * 26), batch_size=1)


def test_a_bad_line_counts_once_however_many_epochs_read_it(tmp_path, caplog):
  good = numbered_lines(6)
  lines = [BAD_LINES["label"][0]] + good[:3] + [BAD_LINES["fields"][0], BAD_LINES["hex"][0]] + good[3:]
  path = write(tmp_path, lines)
  reader = CriteoReader(path, SPEC, batch_size=3, max_bad_lines=3, num_epochs=4)
  with caplog.at_level(logging.WARNING, logger="embedlib.data"):
    assert len(list(reader)) == 8  # 4 epochs of 2 batches; a 4th count would have stopped it
  assert reader.bad_lines.count == 3
  logged = [r.getMessage() for r in caplog.records]
  assert [m.split(": ")[0] for m in logged] == [f"{path}:1", f"{path}:5", f"{path}:6"]
  assert "skipped (malformed line 3, max_bad_lines=3)" in logged[-1]


def test_an_integer_too_large_for_64_bits_is_a_malformed_line(tmp_path):
  path = write(tmp_path, numbered_lines(2) + [make_line(ints=["9" * 30] + [""] * 12)])
  with pytest.raises(CriteoFormatError, match=r"data.tsv:3: integer feature I1 does not fit in 64"):
    list(CriteoReader(path, SPEC, batch_size=1))


def test_truncated_gzip_stops_naming_the_file_and_line(tmp_path):
  path = write(tmp_path, numbered_lines(400), "day.tsv.gz")
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) // 2)
  reader = CriteoReader(path, SPEC, batch_size=10)
  with pytest.raises(CriteoFormatError, match=r"day.tsv.gz:\d+: the gzip data breaks off here .*"
                     "truncated or corrupt"):
    list(reader)
  assert reader.position > 0  # the readable part was read


@pytest.mark.parametrize("name, data, match", [
    ("day.tsv.gz", b"1\t2\n", "ends in .gz but is not gzip data"),
    ("day.tsv", gzip.compress(b"1\t2\n", mtime=0), "is gzip data; name it with a .gz suffix"),
], ids=["gz_suffix_plain_data", "gzip_data_no_suffix"])
def test_gzip_and_suffix_must_agree(tmp_path, name, data, match):
  (tmp_path / name).write_bytes(data)
  with pytest.raises(CriteoFormatError, match=match):
    CriteoReader(str(tmp_path / name), SPEC, batch_size=1)


@pytest.mark.parametrize("process_count", [1, 2])
def test_holdout_splits_the_lines_in_two_disjoint_parts(tmp_path, process_count):
  path = write(tmp_path, numbered_lines(400))
  def ids(split):
    readers = [CriteoReader(path, SPEC, batch_size=2, holdout=0.25, split=split,
                            process_index=p, process_count=process_count)
               for p in range(process_count)]
    return [i for r in readers for b in r for i in line_ids(b).tolist()]
  train, held = ids("train"), ids("holdout")
  assert not set(train) & set(held)
  assert len(set(train) | set(held)) >= 398  # at most one odd line dropped per split
  assert 60 < len(held) < 140  # about a quarter of 400


def test_raw_ids_are_the_values_themselves(tmp_path):
  from embedlib.data.criteo import MISSING_RAW
  cats = ["fffffffffffffff", "", "68fd1e64"] + [f"{i:x}" for i in range(23)]
  path = write(tmp_path, [make_line(cats=cats)] * 2)
  batch = next(iter(CriteoReader(path, SPEC, batch_size=2, raw_ids=True)))
  got = [int(batch["sparse"][f.name][0]) for f in SPEC.features[:4]]
  assert got == [16**15 - 1, MISSING_RAW, 0x68FD1E64, 0]
  assert batch["sparse"]["C1"].dtype == np.int64


def test_workers_give_the_in_process_batches_and_resume_across_counts(tmp_path, monkeypatch):
  # Chunks of 5 lines: a tiny file still spreads over many chunks and both workers.
  monkeypatch.setattr(criteo_chunks, "CHUNK_LINES", 5)
  lines = numbered_lines(47)
  lines[12], lines[31] = "bad\n", make_line("2")
  paths = [write(tmp_path, lines[:22], "a.tsv"), write(tmp_path, lines[22:], "b.tsv")]
  kw = dict(spec=SPEC, batch_size=4, num_epochs=2, max_bad_lines=None, holdout=0.2)
  here = CriteoReader(paths, **kw)
  expected, states = [], []
  for batch in here:
    expected.append(line_ids(batch).tolist())
    states.append(here.get_state())
  # 36 lines of the train split, 34 valid: 8 batches an epoch; the bad ones never show.
  assert len(expected) == 16 and here.bad_lines.count == 2 and here.dropped_examples == 4
  assert not {12, 31} & set(sum(expected, [])) and expected[3] == [14, 16, 17, 18]

  # Started from the in-process state after 3 batches, 2 workers read batches 4..10 ...
  workers = CriteoReader(paths, workers=2, **kw)
  workers.set_state(states[2])
  got = [line_ids(next(workers)).tolist() for _ in range(7)]
  assert got == expected[3:10] and workers.get_state() == states[9]
  workers.close()
  # ... and the in-process reader resumes from theirs, to the end.
  resumed = CriteoReader(paths, **kw)
  resumed.set_state(workers.get_state())
  assert [line_ids(b).tolist() for b in resumed] == expected[10:]


def test_workers_refuse_gzip_naming_the_file_and_the_fix(tmp_path):
  path = write(tmp_path, numbered_lines(4), "day.tsv.gz")
  with pytest.raises(CriteoFormatError, match=r"day.tsv.gz is gzip data, which worker processes "
                     r"can't read from the middle; .*gunzip it.*criteo_binary"):
    CriteoReader(path, SPEC, batch_size=2, workers=2)


@pytest.mark.parametrize("ints, cats", [
    ([5, -3, "", "-0", "007", "123456789012345678"], ["68FD1E64", "", "fffffffffffffff"]),
    (["9223372036854775807", "-9223372036854775808"], ["0x1", "00000000000000a"]),  # parse_line's
    (["+3"], ["a"]), ([" 7"], ["a"]), (["-"], ["a"]), (["1_0"], ["a"]), ([1], ["1000000000000000"]),
    ([1], ["g1"]), ([1], ["-1"]), ([1], [" a"]),
])
@pytest.mark.parametrize("label, end", [("1", "\n"), ("0", "\r\n"), ("2", ""), ("01", "\n")])
def test_the_fast_path_reads_what_parse_line_reads(ints, cats, label, end):
  from embedlib.data.criteo_format import parse_line, parse_usual  # pylint: disable=g-import-not-at-top
  ints = [str(v) for v in ints] + [""] * (13 - len(ints))
  line = "\t".join([label, *ints, *cats, *[""] * (26 - len(cats))]) + end
  try:
    expected = parse_line(line)
  except ValueError:
    expected = None
  got = parse_usual(line.encode())
  assert got == expected or (got is None and expected is not None)  # None: parse_line decides
  if expected is not None and all(len(v) <= 18 for v in ints) and "0x1" not in cats:
    assert got == expected  # the usual lines take the fast path
