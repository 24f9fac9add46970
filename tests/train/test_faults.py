"""Faults a long run meets, each done for real, checking what the user sees and that nothing is lost.

Corrupt checkpoints are real files damaged on disk, then resumed from by the
library call; SIGTERM / SIGINT are sent to a ``python -m train`` process; a
full disk is a small tmpfs filled while the trainer runs (where this user
may mount one; elsewhere the trainer's file size limit is lowered with
``prlimit``, so its next large write fails the same way).
"""

import glob
import logging
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import threading
import urllib.parse

import numpy as np
import orbax.checkpoint as ocp
import pytest

from configs import quickstart
from embedlib import checkpoint
from embedlib.training import events, setup, train_lib
from embedlib.training.signals import StopSignals
from embedlib.training.writers import read_jsonl
from tests import xla_env

# A failed orbax read leaves tensorstore callbacks on a closed event loop;
# the trainer's CLI filters them (embedlib/training/console.py).
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LONG = ["--config.num_train_steps=100000", "--config.log_every=1", "--config.eval_every=100000"]


def _smoke(**overrides):
  config = quickstart.get_config("smoke")
  with config.unlocked():
    config.update(overrides)
  return config


def _command(workdir, *overrides):
  return [sys.executable, "-m", "train", "--config", "configs/quickstart.py:smoke",
          f"--workdir={workdir}", *overrides]


def _env():
  return xla_env.subprocess_env(8)


def _steps(path):
  return [r["step"] for r in read_jsonl(path)]


# -- a corrupt newest checkpoint -------------------------------------------------

#: The finished run's model: the smoke DLRM with one table (``f0``) of its eight. Its
#: checkpoints meet the same faults and restores, and one table is less to compile.
ONE_TABLE = {"table_sizes": (100,), "bag_sizes": (1,)}
ONE_TABLE_FLAGS = [f"--config.data.{k}={v}" for k, v in ONE_TABLE.items()]


def _finished_config(**overrides):
  """``finished_run``'s config, with ``overrides``; on the command line, add ONE_TABLE_FLAGS."""
  config = _smoke(**overrides)
  config.data.update(ONE_TABLE)
  return config


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
  """A smoke run's workdir (``_finished_config``): checkpoints at steps 3 and 6."""
  workdir = tmp_path_factory.mktemp("finished") / "run"
  train_lib.train_and_evaluate(_finished_config(), str(workdir))
  assert sorted(os.listdir(workdir / "checkpoints")) == ["3", "6"]
  return workdir


def _truncate(step_dir):
  (path,) = glob.glob(str(step_dir / "state" / "d" / "*"))
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) // 2)


def _delete(step_dir):
  for path in glob.glob(str(step_dir / "state" / "d" / "*")):
    os.remove(path)


def _table_chunk(step_dir):
  return step_dir / "tables" / urllib.parse.quote("tables/embeddings/tables/f0", safe="") / "3.0"


def _truncate_chunk(step_dir):
  path = _table_chunk(step_dir)
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) // 2)


CORRUPTIONS = {
    "dense data file truncated": _truncate,
    "dense data files deleted": _delete,
    "table chunk truncated": _truncate_chunk,
    "table chunk deleted": lambda d: os.remove(_table_chunk(d)),
    "garbage array metadata": lambda d: (d / "state" / "_METADATA").write_text("{garbage"),
    "garbage table index": lambda d: (d / "tables" / "arrays.json").write_text("[1, 2"),
    "garbage data position": lambda d: (d / "data" / "metadata").write_text("\x00\x01"),
}
# One dense, one table and one JSON corruption in the default run.
FAST = ("dense data file truncated", "table chunk deleted", "garbage data position")
# Each corruption meets the restore a resumed run makes (the checkpointer's
# restore_newest); one resumes a whole training from the checkpoint it
# falls back to. What follows that restore of step 3 is the same whatever
# was damaged in step 6, so the others stop at the restore, with no compile.
TRAINS_ON = "dense data file truncated"


def _restore_newest(workdir, config):
  """The model and optimizer a resumed run builds, restored as it restores them."""
  task = setup.task(config)
  model, optimizer = setup.model_and_optimizer(config, task, task.data_spec(),
                                               setup.make_mesh(config))
  ckpt = checkpoint.Checkpointer(str(workdir / "checkpoints"), max_to_keep=config.max_checkpoints)
  try:
    return ckpt.restore_newest(model, optimizer)
  finally:
    ckpt.close()


@pytest.mark.parametrize("kind", [
    k if k in FAST else pytest.param(k, marks=pytest.mark.slow) for k in CORRUPTIONS])
def test_corrupt_newest_checkpoint_is_set_aside_and_the_previous_one_resumes(
    finished_run, tmp_path, kind, caplog):
  workdir = tmp_path / "run"
  shutil.copytree(finished_run, workdir)
  CORRUPTIONS[kind](workdir / "checkpoints" / "6")
  config = _finished_config(num_train_steps=9)
  with caplog.at_level(logging.INFO, logger="embedlib"):
    if kind != TRAINS_ON:
      step, _ = _restore_newest(workdir, config)
      assert step == 3
    else:
      result = train_lib.train_and_evaluate(config, str(workdir))

  messages = [r.getMessage() for r in caplog.records]
  (warning,) = [m for m in messages if "does not restore" in m]
  assert f"checkpoint {workdir / 'checkpoints' / '6'} does not restore (" in warning
  # The reason names the damaged file (or the table's chunk directory) in it.
  reason = warning.split(" does not restore (", 1)[1]
  assert f"{workdir / 'checkpoints' / '6'}/" in reason.split("); moved it to")[0], warning
  assert "trying step 3" in warning
  assert (workdir / "checkpoints" / "corrupt" / "6" / "state").is_dir()  # kept, not deleted
  if kind != TRAINS_ON:
    return
  assert "resumed from the checkpoint at step 3" in messages
  assert result["step"] == 9
  # Steps 4-6 were trained twice; each appears once.
  assert _steps(workdir / "train.jsonl") == [2, 4, 6, 8, 9]
  assert _steps(workdir / "eval.jsonl") == [3, 6, 9]
  loss = events.read_scalars(str(workdir / "tensorboard" / "train"))["loss"]
  assert [s for s, _ in loss] == [2, 4, 6, 8, 9]


def test_no_checkpoint_restores_moves_each_aside_and_says_so(finished_run, tmp_path, caplog):
  workdir = tmp_path / "run"
  shutil.copytree(finished_run, workdir)
  for step in ("3", "6"):
    _delete(workdir / "checkpoints" / step)
  with pytest.raises(checkpoint.CheckpointRestoreError, match=r"none of the checkpoints .* "
                     r"\(steps \[3, 6\]\) restores; each was moved into .*corrupt"):
    train_lib.train_and_evaluate(_finished_config(num_train_steps=9), str(workdir))
  assert sorted(os.listdir(workdir / "checkpoints" / "corrupt")) == ["3", "6"]


def test_checkpoint_of_another_model_config_is_an_error_not_corruption(finished_run, tmp_path):
  workdir = tmp_path / "run"
  shutil.copytree(finished_run, workdir)
  config = _finished_config(num_train_steps=9)
  config.data.table_sizes = (200,) + tuple(config.data.table_sizes[1:])
  with pytest.raises(checkpoint.CheckpointMismatchError,
                     match=r"checkpoints/6 was saved from another model config: .*tables/f0 is "
                     r"float32\[100, 16\] in the checkpoint, float32\[200, 16\] in the model"):
    train_lib.train_and_evaluate(config, str(workdir))
  assert sorted(os.listdir(workdir / "checkpoints")) == ["3", "6"]  # nothing moved


def test_checkpoint_of_the_earlier_whole_table_format_is_named_not_set_aside(tmp_path):
  directory = tmp_path / "run" / "checkpoints"
  old = ocp.CheckpointManager(str(directory), options=ocp.CheckpointManagerOptions(create=True))
  old.save(3, args=ocp.args.Composite(
      state=ocp.args.StandardSave({"dense": {}, "tables": {"f0": np.zeros((100, 16))}}),
      data=ocp.args.JsonSave({"position": 3})))
  old.wait_until_finished()
  old.close()
  with pytest.raises(checkpoint.CheckpointMismatchError,
                     match=r"checkpoints/3 was written by an earlier embedlib, which kept each "
                     r"table whole .* or use a new --workdir"):
    train_lib.train_and_evaluate(_smoke(), str(tmp_path / "run"))
  assert os.listdir(directory) == ["3"]


def test_rerun_of_a_finished_workdir_is_complete_with_its_config_and_stops_with_another(
    finished_run):
  same = subprocess.run(_command(finished_run, *ONE_TABLE_FLAGS), cwd=ROOT, env=_env(),
                        capture_output=True, text=True, timeout=300)
  assert same.returncode == 0, same.stderr[-3000:]
  assert "is complete: its newest checkpoint is at step 6 of num_train_steps=6" in same.stderr
  assert re.search(r"final eval, at step 6: auc 0\.\d{4}  logloss", same.stderr), same.stderr

  # Fewer steps, so the checkpoint at step 6 is past the end: finished, but not this run.
  another = _command(finished_run, *ONE_TABLE_FLAGS, "--config.num_train_steps=3",
                     "--config.seed=1", "--config.batch_size=16", "--config.model.embed_dim=8",
                     "--config.log_every=1")
  other = subprocess.run(another, cwd=ROOT, env=_env(), capture_output=True, text=True,
                         timeout=300)
  assert other.returncode == 1, other.stderr[-3000:]
  (line,) = [l for l in other.stderr.splitlines() if "error:" in l]
  assert (f"{finished_run} holds a finished run of another config: batch_size is 64 there, "
          "16 here; log_every is 2 there, 1 here; model.embed_dim is 16 there, 8 here; "
          "num_train_steps is 6 there, 3 here (and 1 more). Pass a new --workdir") in line
  assert "Traceback" not in other.stderr
  assert sorted(os.listdir(finished_run / "checkpoints")) == ["3", "6"]


# -- SIGTERM and SIGINT ------------------------------------------------------------


def _run_until(workdir, after_steps, on_step, *overrides, env=None):
  """Runs the trainer; calls ``on_step(proc)`` once ``after_steps`` steps are logged."""
  proc = subprocess.Popen(_command(workdir, *overrides), cwd=ROOT, env=env or _env(),
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  seen, lines = 0, []
  for line in proc.stderr:
    lines.append(line)
    if re.search(r" step \d+  loss", line):
      seen += 1
      if seen == after_steps:
        on_step(proc)
        break
  _, rest = proc.communicate(timeout=300)
  return proc.returncode, "".join(lines) + rest


@pytest.mark.slow
def test_sigterm_and_sigint_save_the_step_reached_and_exit_0(tmp_path):
  workdir = tmp_path / "run"
  code, err = _run_until(workdir, 3, lambda p: p.send_signal(signal.SIGTERM), *LONG)
  assert code == 0, err[-3000:]
  (first,) = re.findall(r"stopped by SIGTERM at step (\d+) of 100000; the checkpoint at step "
                        r"\1 is in .*\. Rerun the same command to resume\.", err)
  assert "Traceback" not in err
  assert "final eval" not in err  # a stopped run is not labelled final
  assert os.listdir(workdir / "checkpoints") == [first]
  assert _steps(workdir / "train.jsonl") == list(range(1, int(first) + 1))

  code, err = _run_until(workdir, 3, lambda p: p.send_signal(signal.SIGINT), *LONG)
  assert code == 0, err[-3000:]
  assert f"resumed from the checkpoint at step {first}" in err
  (second,) = re.findall(r"stopped by SIGINT at step (\d+) of", err)
  assert "Traceback" not in err and "KeyboardInterrupt" not in err
  assert second in os.listdir(workdir / "checkpoints")

  last = int(second) + 2
  done = subprocess.run(_command(workdir, f"--config.num_train_steps={last}",
                                 "--config.log_every=1"),
                        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  assert f"resumed from the checkpoint at step {second}" in done.stderr
  assert _steps(workdir / "train.jsonl") == list(range(1, last + 1))  # nothing lost or repeated
  assert _steps(workdir / "eval.jsonl") == [last]
  scalars = events.read_scalars(str(workdir / "tensorboard" / "train"))
  assert [s for s, _ in scalars["loss"]] == list(range(1, last + 1))
  # Each run's first step compiles: it has no examples/s.
  starts = {1, int(first) + 1, int(second) + 1}
  assert [s for s, _ in scalars["examples_per_sec"]] == [
      s for s in range(1, last + 1) if s not in starts]


@pytest.mark.parametrize("delay", [0.0, 0.01, 0.03])
def test_a_second_sigterm_during_the_final_save_keeps_max_to_keep(tmp_path, delay):
  """The trainer's stop: save and wait inside ``deferred()``, with the second signal landing
  while orbax writes the checkpoint or waits to remove the oldest (where it used to leave 3)."""
  config = _smoke()
  mesh = setup.make_mesh(config)
  task = setup.task(config)
  model, optimizer = setup.model_and_optimizer(config, task, task.data_spec(), mesh)
  ckpt = checkpoint.Checkpointer(str(tmp_path), max_to_keep=2)
  ckpt.save(1, model, optimizer, {})
  ckpt.save(2, model, optimizer, {})
  with pytest.raises(KeyboardInterrupt, match="SIGTERM received twice"):
    try:
      with StopSignals() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested == "SIGTERM"
        second = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGTERM))
        with stop.deferred():
          second.start()
          ckpt.save(3, model, optimizer, {})
          ckpt.wait()
          second.join()
    finally:
      ckpt.close()
  assert sorted(os.listdir(tmp_path)) == ["2", "3"]


# -- a full disk -------------------------------------------------------------------


def _mount_tmpfs(path, size):
  if os.geteuid() != 0 or shutil.which("mount") is None:
    return False
  return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                        capture_output=True).returncode == 0


def _fill(path):
  try:
    with open(os.path.join(path, "filler"), "wb") as f:
      while True:
        f.write(b"\0" * (1 << 16))
        f.flush()
  except OSError:
    pass  # full


@pytest.mark.slow
def test_full_disk_stops_with_one_line_and_the_previous_checkpoint_resumes(tmp_path):
  disk = tmp_path / "disk"
  disk.mkdir()
  tmpfs = _mount_tmpfs(disk, "16m")
  workdir = disk / "run"
  try:
    def fill_after_first_checkpoint(proc):
      while not (workdir / "checkpoints" / "2").is_dir() and proc.poll() is None:
        proc.stderr.readline()
      if tmpfs:
        _fill(disk)
      else:  # no mount here: writes past 64 KiB now fail in the kernel instead
        resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))

    code, err = _run_until(workdir, 2, fill_after_first_checkpoint, *LONG,
                           "--config.checkpoint_every=2")
    assert code == 1, err[-3000:]
    (line,) = [l for l in err.splitlines() if "error:" in l]
    cause = "No space left on device" if tmpfs else "File too large"
    assert cause in line and str(workdir) in line, line
    assert "Traceback" not in err
    intact = int(re.search(r"the checkpoint at step (\d+) is intact", line).group(1))
    assert intact >= 2
    if tmpfs:
      os.remove(disk / "filler")
    done = subprocess.run(_command(workdir, f"--config.num_train_steps={intact + 3}"), cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resumed from the checkpoint at step {intact}" in done.stderr
    steps = _steps(workdir / "train.jsonl")
    assert steps == sorted(set(steps)) and steps[-1] == intact + 3
  finally:
    if tmpfs:
      subprocess.run(["umount", "-l", str(disk)], check=False)


# -- SIGKILL mid raw-id run -----------------------------------------------------------

#: Raw ids into dynamic tables far smaller than the ids seen: admission and eviction.
DYNAMIC = {"capacity": 64, "bucket_size": 8, "admit_after": 2, "eviction": "lfu"}
RAW = ["--config.data.raw_ids=True", "--config.checkpoint_every=1",
       "--config.max_checkpoints=100", "--config.log_every=1",
       *(f"--config.model.dynamic.{k}={v}" for k, v in DYNAMIC.items())]


def _raw_smoke(**overrides):
  config = _smoke(checkpoint_every=1, max_checkpoints=100, log_every=1, **overrides)
  with config.unlocked():
    config.data.raw_ids = True
    config.model.dynamic.update(DYNAMIC)
  return config


def _maps_and_rows(workdir, config, step):
  """Each dynamic table's map (resident ids, scores, placement clocks, clock) and rows."""
  task = setup.task(config)
  model, optimizer = setup.model_and_optimizer(config, task, task.data_spec(),
                                               setup.make_mesh(config))
  ckpt = checkpoint.Checkpointer(str(workdir / "checkpoints"), max_to_keep=100)
  try:
    ckpt.restore(model, optimizer, step=step)
  finally:
    ckpt.close()
  return {name: (t.resident(), np.asarray(t.score[...]), np.asarray(t.placed_at[...]),
                 int(t.clock[...]), np.asarray(t.rows.embedding[...]))
          for name, t in model.embeddings.dynamic.items()}


def _assert_same(got, want):
  assert got.keys() == want.keys() and got
  for name in want:
    assert got[name][0] == want[name][0] and got[name][0], name
    assert got[name][3] == want[name][3], name
    for a, b in zip(got[name][1:], want[name][1:]):
      np.testing.assert_array_equal(a, b, err_msg=name)


@pytest.mark.slow
def test_sigkill_mid_raw_id_run_resumes_its_maps_from_the_last_intact_checkpoint(tmp_path):
  """Killed mid-run (a checkpoint each step, so the kill may land mid-save), pipelined: the
  newest intact checkpoint holds the maps with their rows, and the resumed run ends
  where an uninterrupted in-line run does, bit for bit (compiled as a user's run is:
  ``xla_env.default_subprocess_env``)."""
  workdir, env = tmp_path / "run", xla_env.default_subprocess_env(8)
  code, err = _run_until(workdir, 4, lambda p: p.kill(), *LONG, *RAW, "--config.pipeline=True",
                         env=env)
  assert code == -signal.SIGKILL, err[-3000:]
  found = _restore_newest(workdir, _raw_smoke(pipeline=True))
  assert found is not None, os.listdir(workdir / "checkpoints")
  saved = found[0]
  assert saved >= 1 and found[1]
  last = saved + 2
  straight = tmp_path / "straight"
  tail = ["--config.eval_every=100000", f"--config.num_train_steps={last}"]
  # The uninterrupted in-line run, in a process like the killed one (its devices).
  runs = [subprocess.Popen(_command(w, *RAW, *extra, *tail), cwd=ROOT, env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
          for w, extra in ((workdir, ["--config.pipeline=True"]), (straight, []))]
  errs = [p.communicate(timeout=900)[1] for p in runs]
  for p, e in zip(runs, errs):
    assert p.returncode == 0, e[-3000:]
  assert f"resumed from the checkpoint at step {saved}" in errs[0]
  # The checkpoint the killed run left: the uninterrupted run's maps and rows at its step.
  _assert_same(_maps_and_rows(workdir, _raw_smoke(), saved),
               _maps_and_rows(straight, _raw_smoke(), saved))
  _assert_same(_maps_and_rows(workdir, _raw_smoke(), last),
               _maps_and_rows(straight, _raw_smoke(), last))
  want = {r["step"]: r for r in read_jsonl(straight / "train.jsonl")}
  got = {r["step"]: r for r in read_jsonl(workdir / "train.jsonl")}
  for step in range(saved + 1, last + 1):
    assert got[step]["loss"] == want[step]["loss"], step
