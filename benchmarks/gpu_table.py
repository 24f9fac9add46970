"""Writes ``embedlib/kernels/gpu_measured.py`` from the newest GPU sweep results: what ``auto`` runs.

Run after a GPU session has kept its results as
``benchmarks/results/gpu_<date>.json`` (``bash benchmarks/gpu_session.sh
--confirm --json benchmarks/results/gpu_$(date +%F).json``, which also
writes the second sweep's ``gpu_<date>_confirm.json``)::

  python benchmarks/gpu_table.py            # rewrite the table from the newest results file
  python benchmarks/gpu_table.py --check    # exit 1 if the table is not what that file gives

`embedlib.kernels.gpu_choice.table_from_results` picks, for each measured
kernel, dtype, width and bag size, the variant with the best worst-case
speed-up over XLA's ops, or XLA's ops. The files of the newest date are
read together, each a separate run (``"run"``): a variant must win in every
run that measured its case, so a second sweep confirms the first. The
table file says which results files it came from. With no results file the table is empty: XLA's ops
everywhere. ``tests/kernels/test_gpu_choice.py`` runs ``--check``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from embedlib.kernels import gpu_choice  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
TABLE = ROOT / "embedlib" / "kernels" / "gpu_measured.py"
_NAME = re.compile(r"gpu_(\d{4}-\d{2}-\d{2})(?:[_-].*)?\.json")


def newest_results(directory: pathlib.Path = RESULTS) -> pathlib.Path | None:
  """The results file ``gpu_<YYYY-MM-DD>[_suffix].json`` of the latest date (then name), or None."""
  files = [p for p in directory.glob("gpu_*.json") if _NAME.fullmatch(p.name)]
  return max(files, key=lambda p: (_NAME.fullmatch(p.name).group(1), p.name), default=None)


def newest_runs(directory: pathlib.Path = RESULTS) -> list[pathlib.Path]:
  """Every results file of the newest date (a sweep and its confirming rerun), by name."""
  newest = newest_results(directory)
  if newest is None:
    return []
  date = _NAME.fullmatch(newest.name).group(1)
  return sorted(p for p in directory.glob(f"gpu_{date}*.json") if _NAME.fullmatch(p.name))


def table_text(directory: pathlib.Path = RESULTS) -> str:
  """The ``gpu_measured.py`` the newest date's results files in ``directory`` give."""
  paths = newest_runs(directory)
  if not paths:
    return gpu_choice.module_text((), None)
  cases = []
  for run, path in enumerate(paths):
    these = json.loads(path.read_text())
    if isinstance(these, dict):   # a file written with its run's details beside the cases
      these = these["cases"]
    cases += [dict(c, run=run) for c in these]
  source = ", ".join(p.relative_to(ROOT).as_posix() if p.is_relative_to(ROOT) else p.name
                     for p in paths)
  return gpu_choice.module_text(gpu_choice.table_from_results(cases), source)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--results", type=pathlib.Path, default=RESULTS,
                      help="folder of gpu_<date>.json files")
  parser.add_argument("--out", type=pathlib.Path, default=TABLE, help="the table module to write")
  parser.add_argument("--check", action="store_true",
                      help="exit 1 if --out differs from what the results give; write nothing")
  args = parser.parse_args(argv)
  text = table_text(args.results)
  if args.check:
    same = args.out.exists() and args.out.read_text() == text
    print(f"gpu_table: {args.out} {'matches' if same else 'DIFFERS from'} "
          f"{[p.name for p in newest_runs(args.results)] or 'no results file'}")
    return 0 if same else 1
  args.out.write_text(text)
  print(f"gpu_table: wrote {args.out} from "
        f"{[p.name for p in newest_runs(args.results)] or 'no results file'}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
