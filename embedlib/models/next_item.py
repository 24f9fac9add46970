"""What the next-item encoders (SASRec, HSTU) share: the input embedding and tied logits.

A next-item batch (``embedlib.data.next_item``) holds each row's items
left-padded with 0 to ``max_len``; the encoder returns one vector per
position, and position ``i``'s vector scores every item as the one after
item ``i``, through the item table itself (``ShardedEmbed.attend``): the
output layer is tied to the input embedding, so an item vocabulary of any
size is split over the mesh like any table.

The logits may add a learned repeat bias to the items in the row's own
input (``repeat_bias``; RepeatNet's repeat-or-explore choice, Ren et al.,
AAAI 2019, reduced to one logit). One output vector can't score tens of
particular items low at once: it is built from those items' rows, so on
MovieLens, where nobody rates a movie twice, a tied SASRec puts the movies
it is reading among its own top ten. The bias starts at 0 and is learned:
negative where users don't repeat, positive where they do. It sees only
the row's items, never the user's history beyond them.

The item table may be an ``embedlib.DynamicEmbed`` (raw ids): the batch's
raw ids become indices by ``to_rows`` first, one lookup of the inputs and
targets together (one step of the table's admission and eviction, so no id
of the batch evicts another), each index a row plus 1 and 0 where the id is
padding or not resident, so the model reads them as it reads dense ids
(0 pads). A history item that is not resident reads as padding. The logits
are then the table's rows ``[..., capacity]`` (row ``r`` is index
``r + 1``), the rows that hold no id masked out of the softmax and of any
ranking.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from embedlib import logits as logits_lib
from embedlib.collection import EmbeddingCollection, FeatureSpec, TableSpec
from embedlib import options
from embedlib.dynamic import DynamicEmbed
from embedlib.embed import ShardedEmbed
from embedlib.models.blocks import no_dropout

#: The repeat bias's logit per unit of its parameter (``NextItemEmbed``).
_REPEAT_BIAS_SCALE = 10.0


def causal_mask(valid: jax.Array) -> jax.Array:
  """Which keys each query may attend to: earlier or equal real positions, bool ``[B, 1, L, L]``.

  A padded query attends to itself alone, so no row of the mask is empty
  (its output is never read).

  >>> causal_mask(jnp.array([[False, True, True]]))[0, 0].astype(int)
  Array([[1, 0, 0],
         [0, 1, 0],
         [0, 1, 1]], dtype=int32)
  """
  length = valid.shape[1]
  earlier = jnp.tril(jnp.ones((length, length), bool))
  mask = earlier[None] & valid[:, None, :]
  return (mask | jnp.eye(length, dtype=bool)[None])[:, None]


def masked(values: jax.Array, keep: jax.Array) -> jax.Array:
  """``values`` with the columns ``keep`` (bool ``[V]``) doesn't hold at the dtype's least."""
  return jnp.where(keep, values, jnp.finfo(values.dtype).min)


def seen_items(items: jax.Array, vocab: int, *, per_position: bool) -> jax.Array:
  """Which of ``vocab`` item rows each row's input holds: bool ``[B, L, vocab]`` or ``[B, vocab]``.

  ``per_position``: position ``i`` counts the items at or before ``i`` (the
  ones its output has read); otherwise every item of the row counts. Row 0
  (padding) is never seen; rows past the table (a padded vocabulary) never are.

  >>> seen_items(jnp.array([[0, 2, 1, 2]]), 4, per_position=True)[0].astype(int)
  Array([[0, 0, 0, 0],
         [0, 0, 1, 0],
         [0, 1, 1, 0],
         [0, 1, 1, 0]], dtype=int32)
  """
  length = items.shape[1]
  hit = (items[..., None] == jnp.arange(vocab)) & (items > 0)[..., None]  # [B, L, vocab]
  first = jnp.min(jnp.where(hit, jnp.arange(length)[:, None], length), axis=1)  # [B, vocab]
  if per_position:
    return first[:, None, :] <= jnp.arange(length)[None, :, None]
  return first < length


class ItemColumnIds(nnx.Variable):
  """Each item's side-column ids: data the model reads, never trained."""


class ItemColumns(nnx.Module):
  """An item's side columns (``embedlib.tabular.item_side``), pooled and summed.

  Each column has a table of ``width`` (the mean of a bag's rows); the
  item's vector is the sum over its columns, added to its id's row.

  >>> import numpy as np
  >>> from flax import nnx
  >>> side = ItemColumns({"genre": np.array([[-1, -1], [1, 2], [2, -1]])}, 4, rngs=nnx.Rngs(0))
  >>> side(jnp.array([[0, 1, 2]])).shape
  (1, 3, 4)
  """

  def __init__(self, columns: dict, width: int, *, mesh=None, rngs: nnx.Rngs):
    self.names = tuple(sorted(columns))
    widths = [np.asarray(columns[n]).shape[1] for n in self.names]
    self.offsets = tuple(int(x) for x in np.cumsum([0] + widths))
    self.ids = ItemColumnIds(jnp.asarray(
        np.concatenate([np.asarray(columns[n], np.int32) for n in self.names], axis=1)))
    tables = [TableSpec(n, int(max(np.asarray(columns[n]).max(), 0)) + 1, width)
              for n in self.names]
    features = [FeatureSpec(n, n, combiner="mean") for n in self.names]
    self.embeddings = EmbeddingCollection(tables, features, mesh=mesh, rngs=rngs)

  def __call__(self, items: jax.Array) -> jax.Array:
    """``items`` int ``[B, L]`` (0 pads) -> the sum of their columns' vectors ``[B, L, width]``."""
    ids = jnp.take(self.ids[...], items.reshape(-1), axis=0)
    inputs = {n: ids[:, lo:hi] for n, lo, hi in zip(self.names, self.offsets, self.offsets[1:])}
    pooled = self.embeddings(inputs)
    total = sum(pooled[n] for n in self.names)
    return total.reshape(*items.shape, total.shape[-1])


class NextItemEmbed(nnx.Module):
  """Item rows (zero at padding) times ``sqrt(width)`` if asked, plus learned positions.

  >>> from flax import nnx
  >>> items = ShardedEmbed(11, 8, rngs=nnx.Rngs(0))
  >>> x, valid = NextItemEmbed(items, max_len=4, rngs=nnx.Rngs(0))(jnp.array([[0, 0, 3, 7]]))
  >>> x.shape, valid.tolist()
  ((1, 4, 8), [[False, False, True, True]])

  Args:
    items: the item table, ``num_items + 1`` rows (row 0: padding), or a
      ``DynamicEmbed`` read by raw ids (module docstring).
    max_len: ``L``, the positions.
    scale: multiply the item rows by ``sqrt(width)`` (the SASRec paper's).
    repeat_bias: learn a logit added to the items in the row's input
      (module docstring).
    side: the items' side columns (``ItemColumns``), added to their rows;
      None for ids alone.
    rngs: random number generators.
  """

  def __init__(self, items: ShardedEmbed | DynamicEmbed, *, max_len: int, scale: bool = False,
               repeat_bias: bool = False, side: ItemColumns | None = None, rngs: nnx.Rngs):
    if max_len < 1:
      raise ValueError(f"config.data.max_len must be >= 1, got {max_len}.")
    if isinstance(items, DynamicEmbed) and items.default_row is not None:
      raise ValueError(f"{items.name}: default='learned', but a next-item model reads a "
                       "history item that is not resident as padding and never scores the "
                       "default row, so it would not be learned; use default='zero'.")
    if side is not None and isinstance(items, DynamicEmbed):
      raise ValueError("config.data.item_columns: the side columns are read by dense item "
                       "ids; leave config.data.raw_ids off with them.")
    self.items = items
    self.side = side
    self.max_len = max_len
    self.scale = scale
    self.positions = nnx.Embed(max_len, items.features, rngs=rngs)
    self.norm = nnx.LayerNorm(items.features, rngs=rngs)
    # Stored as a tenth of the logit: Adam moves a scalar about its learning
    # rate a step, and the logit has units to travel in the first epochs.
    self.repeat_bias = nnx.Param(jnp.zeros((), jnp.float32)) if repeat_bias else None

  @property
  def dynamic(self) -> bool:
    """The item table is read by raw ids (a ``DynamicEmbed``)."""
    return isinstance(self.items, DynamicEmbed)

  def to_rows(self, batch: dict, keys=("items", "targets", "target", "exclude")) -> dict:
    """``batch`` with the raw ids of ``keys`` as indices: row + 1, 0 for padding or absent.

    One lookup of every key's ids: in training mode one step of the
    table's policy (module docstring). Without a dynamic table, ``batch``.
    """
    if not self.dynamic:
      return batch
    keys = [k for k in keys if k in batch]
    parts = [jnp.asarray(batch[k]).astype(jnp.int32) for k in keys]
    rows = self.items.rows_of(jnp.concatenate([p.reshape(-1) for p in parts]))
    out, start = dict(batch), 0
    for k, p in zip(keys, parts):
      out[k] = (rows[start:start + p.size] + 1).reshape(p.shape)
      start += p.size
    return out

  @property
  def repeat_logit(self) -> float | None:
    """The learned repeat bias as the logit it adds (``None`` without one)."""
    return None if self.repeat_bias is None else _REPEAT_BIAS_SCALE * float(self.repeat_bias[...])

  def __call__(self, items: jax.Array, dropout=no_dropout) -> tuple[jax.Array, jax.Array]:
    """``items`` int ``[B, L]`` -> (``x [B, L, width]`` normalised, ``valid`` bool ``[B, L]``)."""
    if items.shape[1] != self.max_len:
      raise ValueError(f"next-item rows hold {items.shape[1]} items, the model "
                       f"config.data.max_len={self.max_len}; build both from one config.")
    valid = items > 0
    table = self.items.rows if self.dynamic else self.items
    rows = table(items - 1 if self.dynamic else items)
    if self.side is not None:
      rows = rows + self.side(items).astype(rows.dtype)
    rows = rows * valid[..., None].astype(rows.dtype)
    if self.scale:
      rows = rows * jnp.sqrt(jnp.asarray(self.items.features, rows.dtype))
    x = rows + self.positions(jnp.arange(self.max_len))[None]
    return dropout(self.norm(x)), valid

  def logits(self, hidden: jax.Array, items: jax.Array | None = None, *,
             vocab_split: bool = False):
    """Scores of every item row (0 included) from ``hidden``: ``[..., num_items + 1]``.

    A dynamic table's: ``[..., capacity]``, row ``r`` the item of index
    ``r + 1``, the rows that hold no id at the dtype's least.

    ``hidden`` is every position's output ``[B, L, width]`` or one per row
    ``[B, width]`` (the last position's). ``items``: the rows' input
    ``[B, L]``, which the repeat bias needs: with ``[B, L, width]`` each
    position's own items get it, with ``[B, width]`` all the row's.

    ``vocab_split``: leave each device the logits of the rows it holds,
    where the table is split by rows (a ``VocabShardedLogits`` when the
    split doesn't divide the vocabulary), for ``vocab_parallel_cross_entropy``.
    """
    table = self.items.rows if self.dynamic else self.items
    plan = table.plan
    if vocab_split and table.mesh is not None and plan.strategy in options.ROW_BLOCKS:
      spec = P(*(None,) * (hidden.ndim - 1), plan.table_axes)
      out = table.attend(hidden, out_sharding=spec)
    else:
      out = table.attend(hidden)
    if self.repeat_bias is None:
      return self._resident(out)
    if items is None:
      raise ValueError("this model learns a repeat bias (config.model.repeat_bias): pass the "
                       "rows' input items, model.logits(hidden, batch['items']).")
    if hidden.ndim not in (2, 3) or items.shape[0] != hidden.shape[0] or (
        hidden.ndim == 3 and items.shape[1] != hidden.shape[1]):
      raise ValueError(f"logits: hidden {hidden.shape} and items {items.shape} don't match; "
                       "give hidden [B, L, width] or [B, width] and items [B, L].")
    split = isinstance(out, logits_lib.VocabShardedLogits)
    values = out.padded if split else out  # a padded vocabulary's rows are never seen
    shift = int(self.dynamic)  # a dynamic table's index r + 1 is row r
    seen = seen_items(items, values.shape[-1] + shift, per_position=hidden.ndim == 3)
    seen = seen[..., shift:]
    values = values + (_REPEAT_BIAS_SCALE * self.repeat_bias[...]).astype(values.dtype) * seen
    return self._resident(dataclasses.replace(out, padded=values) if split else values)

  def _resident(self, out):
    """A dynamic table's logits with its rows that hold no id masked out."""
    if not self.dynamic:
      return out
    keep = self.items.score[...] >= 0  # [capacity], split as the rows are
    if isinstance(out, logits_lib.VocabShardedLogits):
      pad = out.padded.shape[-1] - keep.shape[0]
      return dataclasses.replace(out, padded=masked(out.padded, jnp.pad(keep, (0, pad))))
    return masked(out, keep)
