"""TensorBoard scalar event files: one per directory, each (tag, step) once.

A resumed run redoes the steps after its checkpoint. Appending a new event
file per restart, as a plain ``SummaryWriter`` does, leaves TensorBoard
with two values for each redone step; so opening an ``EventFile`` rewrites
the directory's events up to the resumed step into one new file and deletes
the old ones. Writes are synchronous (a few records per logging step): a
full disk raises in the caller, not in a background thread.

The files are TFRecord framed ``Event`` protos (tensorboardX's), readable by
TensorBoard and by ``read_scalars``.
"""

from __future__ import annotations

import glob
import os
import socket
import struct
import time

from tensorboardX.proto import event_pb2, summary_pb2
from tensorboardX.record_writer import masked_crc32c

_PREFIX = "events.out.tfevents."


def _frame(data: bytes) -> bytes:
  header = struct.pack("<Q", len(data))
  return (header + struct.pack("<I", masked_crc32c(header)) + data +
          struct.pack("<I", masked_crc32c(data)))


def _records(path: str):
  """The records of one event file; stops at a torn or corrupt tail."""
  with open(path, "rb") as f:
    data = f.read()
  pos = 0
  while pos + 12 <= len(data):
    header = data[pos:pos + 8]
    (length,) = struct.unpack("<Q", header)
    (crc,) = struct.unpack("<I", data[pos + 8:pos + 12])
    end = pos + 12 + length + 4
    if crc != masked_crc32c(header) or end > len(data):
      return
    body = data[pos + 12:pos + 12 + length]
    if struct.unpack("<I", data[end - 4:end])[0] != masked_crc32c(body):
      return
    yield body
    pos = end


def event_files(logdir: str) -> list[str]:
  """The event files in ``logdir``, oldest first."""
  return sorted(glob.glob(os.path.join(logdir, _PREFIX + "*")))


def _scalar_events(logdir: str) -> list:
  """Every scalar event in ``logdir``'s files, oldest file first."""
  events = []
  for path in event_files(logdir):
    for body in _records(path):
      event = event_pb2.Event.FromString(body)
      if event.HasField("summary"):
        events.append(event)
  return events


def read_scalars(logdir: str) -> dict[str, list[tuple[int, float]]]:
  """``{tag: [(step, value), ...]}`` from the event files in ``logdir``, in file order."""
  scalars: dict[str, list[tuple[int, float]]] = {}
  for event in _scalar_events(logdir):
    for value in event.summary.value:
      scalars.setdefault(value.tag, []).append((int(event.step), float(value.simple_value)))
  return scalars


class EventFile:
  """Appends scalars to one TensorBoard event file in ``logdir``.

  Args:
    logdir: the directory (created if missing), e.g. ``workdir/tensorboard/train``.
    keep_through_step: scalars already in ``logdir`` at steps up to this one
      are kept (copied into the new file, once per tag and step); later
      ones, and the old files, are dropped.
  """

  def __init__(self, logdir: str, *, keep_through_step: int = 0):
    os.makedirs(logdir, exist_ok=True)
    old = event_files(logdir)
    kept: dict[tuple[str, int], tuple[float, float]] = {}  # (tag, step) -> (value, wall_time)
    for event in _scalar_events(logdir):
      if event.step <= keep_through_step:
        for value in event.summary.value:
          kept[(value.tag, int(event.step))] = (value.simple_value, event.wall_time)
    name = f"{_PREFIX}{time.time_ns()}.{socket.gethostname()}.{os.getpid()}"
    self.path = os.path.join(logdir, name)
    self._file = open(self.path, "wb")
    self._append(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))
    for (tag, step), (value, wall_time) in sorted(kept.items(), key=lambda kv: kv[0][1]):
      self._append(_scalar_event(step, {tag: value}, wall_time))
    self.flush()
    for path in old:  # only once the kept events are safely in the new file
      os.remove(path)

  def _append(self, event) -> None:
    self._file.write(_frame(event.SerializeToString()))

  def write(self, step: int, scalars: dict) -> None:
    """Appends one event holding ``scalars`` at ``step`` and flushes it to disk."""
    self._append(_scalar_event(step, scalars, time.time()))
    self.flush()

  def flush(self) -> None:
    self._file.flush()
    os.fsync(self._file.fileno())

  def close(self) -> None:
    if not self._file.closed:
      self._file.close()


def _scalar_event(step: int, scalars: dict, wall_time: float):
  summary = summary_pb2.Summary(value=[
      summary_pb2.Summary.Value(tag=tag, simple_value=float(value))
      for tag, value in scalars.items()])
  return event_pb2.Event(wall_time=wall_time, step=int(step), summary=summary)
