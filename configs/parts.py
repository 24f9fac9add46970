"""Blocks the configs share: mesh, optimizers, schedule, planted requests, transformer.

Each returns a fresh ``ConfigDict`` (or sets fields on one), so a config
changes its copy without touching another config's.
"""

import ml_collections

from embedlib.data.sequences import ACTIONS


def base(task: dict) -> ml_collections.ConfigDict:
  """Seed, a 1-D ``batch`` mesh over every device, and the task."""
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.mesh_shape = (-1,)
  config.mesh_axes = ("batch",)
  config.task = ml_collections.ConfigDict(task)
  config.pipeline = False
  config.early_fetch = 0.0
  return config


def optimizers(*, dense_lr: float, sparse_lr: float,
               warmup_steps: int) -> ml_collections.ConfigDict:
  """Adam with warmup and cosine decay on the dense weights, row-wise AdaGrad on tables."""
  optim = ml_collections.ConfigDict()
  optim.dense = ml_collections.ConfigDict(dict(
      name="adam", learning_rate=dense_lr, schedule="warmup_cosine", warmup_steps=warmup_steps))
  optim.sparse = ml_collections.ConfigDict(dict(
      name="rowwise_adagrad", learning_rate=sparse_lr, schedule="constant", warmup_steps=0))
  return optim


def set_schedule(config, *, batch_size: int, num_train_steps: int, eval_every: int,
                 eval_batches: int, log_every: int = 100) -> None:
  """Batch, steps, logging, eval and checkpoints (one at every eval, two kept)."""
  config.batch_size = batch_size
  config.num_train_steps = num_train_steps
  config.log_every = log_every
  config.eval_every = eval_every
  config.eval_batches = eval_batches
  config.checkpoint_every = eval_every
  config.max_checkpoints = 2


def set_smoke_schedule(config, *, batch_size: int = 32) -> None:
  """A few steps that still log, evaluate, checkpoint and resume: what the tests run."""
  set_schedule(config, batch_size=batch_size, num_train_steps=6, log_every=2, eval_every=3,
               eval_batches=2)


def planted_requests(source: str, **fields) -> ml_collections.ConfigDict:
  """The planted request world (users, items, authors, topics, history) of ``source``."""
  return ml_collections.ConfigDict(dict(
      source=source, num_users=50_000, num_items=100_000, num_authors=2_000, num_topics=50,
      history_len=32, actions=ACTIONS, zipf_exponent=1.0, prefetch=2, **fields))


def smoke_requests(data, **fields) -> None:
  """A world small enough for a few test steps."""
  data.update(num_users=200, num_authors=40, num_topics=8, history_len=8, **fields)


def transformer(*, num_layers: int, width: int = 32) -> dict:
  """The ranker's transformer trunk (candidates attend to the context and themselves)."""
  return dict(width=width, num_layers=num_layers, num_heads=2, mlp_ratio=2, causal=False)


def multi_hash(*, num_buckets: int, features: int, seed: int) -> ml_collections.ConfigDict:
  """A multi-hash table: 2 hashes into ``num_buckets`` rows, concatenated."""
  return ml_collections.ConfigDict(dict(
      num_buckets=num_buckets, num_hashes=2, features=features, combiner="concat", seed=seed))


def dynamic_table(*, capacity: int, bucket_size: int = 128) -> ml_collections.ConfigDict:
  """One dynamic table's settings (``embedlib.DynamicEmbed``), read by raw ids."""
  return ml_collections.ConfigDict(dict(
      capacity=capacity, bucket_size=bucket_size, admit_after=1, eviction="lru",
      decay_every=0, default="zero"))
