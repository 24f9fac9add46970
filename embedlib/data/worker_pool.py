"""Items of an indexed stream made in grain worker processes, handed back in order.

The one grain pipeline of the library's readers (the Criteo TSV reader's
chunks, the tabular reader's chunks): item ``g`` is ``load(g)`` for ``g``
in ``first .. stop - 1``, computed in ``workers`` processes (item ``g`` by
worker ``g % workers``) and yielded in index order, so the stream is the
one ``map(load, range(first, stop))`` gives in this process.
"""

from __future__ import annotations


def ordered_map(load, first: int, stop: int, *, workers: int, buffer: int = 1):
  """``load(g)`` for ``g`` in ``first .. stop - 1``, made by ``workers`` processes, in order.

  Args:
    load: a picklable callable (a worker process runs it).
    first, stop: the range of indices.
    workers: worker processes (>= 1).
    buffer: items each worker keeps ready.

  Returns:
    An iterator with ``close()``, which stops the workers.
  """
  import grain  # pylint: disable=g-import-not-at-top
  from absl import flags  # pylint: disable=g-import-not-at-top

  # grain reads its absl flags when it starts workers; a program that never
  # parsed flags (a notebook, a test) would fail there.
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
  dataset = grain.MapDataset.range(first, max(stop, first)).map(load)
  # Parsing holds the GIL: threads inside a worker would only add items
  # made ahead (grain's default reads 500 ahead with 16 threads).
  read = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
  options = grain.MultiprocessingOptions(num_workers=workers, per_worker_buffer_size=buffer)
  # Items come back pickled through grain's queues rather than in shared
  # memory: a copy costs little beside the parse, and shared blocks still
  # queued when a program ends are reported as leaked.
  pickled = grain.experimental.DatasetOptions(min_shm_size=1 << 62)
  ordered = grain.experimental.WithOptionsIterDataset(dataset.to_iter_dataset(read), pickled)
  return iter(ordered.mp_prefetch(options))
