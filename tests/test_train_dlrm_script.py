"""``benchmarks/train_dlrm.py --full``: its two workers' rounds interleave where the memory allows.

The workers and their timing are replaced by stand-ins: what is checked is
which workers share the timed rounds, and that a run falling back to one
worker at a time says so in its record. No time is measured.
"""

import argparse

import pytest

from tests import benchmark_scripts


class FakeRecord:
  def __init__(self):
    self.notes, self.ratios = [], {}

  def note(self, text):
    self.notes.append(text)

  def probe(self):
    pass

  def add_times(self, times, unit="ms", prefix=""):
    pass

  def ratio(self, name, value):
    self.ratios[name] = value


@pytest.fixture
def script(monkeypatch):
  module = benchmark_scripts.load("train_dlrm")
  groups = []

  def time_workers(specs, repeats, steps, batch, between_rounds=None):
    groups.append(sorted(specs))
    return ({n: [1000.0] * repeats for n in specs}, {n: 1.0 for n in specs},
            {n: 0.5 for n in specs})

  monkeypatch.setattr(module, "make_batches", lambda *a, **k: 1.0)
  monkeypatch.setattr(module, "_workers", lambda args, data, sizes: {
      module.EMBEDLIB: ([], {}), module.TORCHREC: ([], {})})
  monkeypatch.setattr(module, "_time_workers", time_workers)
  module.groups = groups
  return module


def _run(script, available_gib, one_at_a_time=False):
  script._available_gib = lambda: available_gib
  args = argparse.Namespace(full=True, one_at_a_time=one_at_a_time, keep_freed=False)
  record = FakeRecord()
  script.run(args, [4] * 26, 8, 2, 1, "unused.npz", record)
  return record


def test_full_interleaves_both_workers_when_they_fit(script):
  record = _run(script, available_gib=2 * script.FULL_WORKER_GIB + 1)
  assert script.groups == [sorted([script.EMBEDLIB, script.TORCHREC])]
  assert not any("not interleaved" in n for n in record.notes)
  assert record.ratios["vs_torchrec_fused"] == pytest.approx(1.0)


@pytest.mark.parametrize("available,asked", [(1.0, False), (1e6, True)])
def test_full_runs_one_worker_at_a_time_when_short_of_memory_or_asked(script, available, asked):
  record = _run(script, available_gib=available, one_at_a_time=asked)
  assert script.groups == [[script.EMBEDLIB], [script.TORCHREC]]
  assert any("one worker at a time, not interleaved" in n for n in record.notes)


@pytest.mark.parametrize("switch", [None, "0"])
def test_the_torchrec_worker_gets_huge_pages_where_embedlib_does(switch, monkeypatch, tmp_path):
  # embedlib's CPU kernels move large tables onto 2 MiB pages; glibc's
  # tunable gives the PyTorch worker's tables the same (worker_protocol.peer_env).
  module = benchmark_scripts.load("train_dlrm")
  monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
  if switch is None:
    monkeypatch.delenv("EMBEDLIB_HUGE_PAGES", raising=False)
  else:
    monkeypatch.setenv("EMBEDLIB_HUGE_PAGES", switch)
  peer = tmp_path / "python"
  peer.write_text("")
  args = argparse.Namespace(full=True, keep_freed=True, eight_devices=False, warmup=1,
                            peer_python=str(peer), torch_threads=2)
  workers = module._workers(args, "unused.npz", [4] * 26)
  torch_env, jax_env = workers[module.TORCHREC][1], workers[module.EMBEDLIB][1]
  want = None if switch else "glibc.malloc.hugetlb=1"
  assert torch_env.get("GLIBC_TUNABLES") == want
  assert "GLIBC_TUNABLES" not in jax_env   # embedlib's tables: its kernels' advice alone
  assert torch_env["MALLOC_MMAP_THRESHOLD_"] == jax_env["MALLOC_MMAP_THRESHOLD_"]
