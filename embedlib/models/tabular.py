"""Models whose inputs are a table's columns (``embedlib.tabular``): one table a column.

``build_tabular(model_config, schema, ...)`` reads the schema: each id
column (categorical, list, user / item id) gets its own table, sized as its
id kind says (a vocabulary's size, a hashed table's rows, or a dynamic
table's capacity, ``embedlib.DynamicEmbed``, rounded up to whole buckets
on every device: ``sized``, which a run saves); a list column is pooled with ``config.model.combiner``
(weighted by its weights column); the dense columns are the dense input.
Then by ``config.model.name``:

- ``dlrm`` / ``dcn`` (``dcn_v2``): the DLRM family on those tables;
- ``ranker``: ``FeatureTransformer``, each feature a token of a
  transformer (the ranker's trunk), read out through a learned token;
- ``two_tower``: ``TableTwoTower``, the user's columns (and the row's own)
  in the user tower and the item's in the item tower.

A model with several label columns has one output each.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from embedlib.collection import DynamicSpec, EmbeddingCollection, FeatureSpec, TableSpec
from embedlib.models.blocks import MLP
from embedlib.models.dlrm import CROSS, DLRM, DOT
from embedlib.models.transformer import Transformer
from embedlib.models.two_tower import check_temperature, l2_normalize
from embedlib.plan import CollectionLayout
from embedlib.tabular import schema as schema_lib
from embedlib.tabular.schema import Schema

#: config.model.name of the models built here (``dcn_v2`` is ``dcn``).
CTR_NAMES = ("dlrm", "dcn", "dcn_v2", "ranker")
TWO_TOWER = "two_tower"
NAMES = CTR_NAMES + (TWO_TOWER,)


#: ``config.model.dynamic.bucket_size`` where the config leaves it out.
BUCKET_SIZE = 128


def bucket_size(model_config) -> int:
  """The dynamic tables' bucket size of ``config.model``."""
  return int((model_config.get("dynamic") or {}).get("bucket_size", BUCKET_SIZE))


def _capacity(rows: int, bucket: int, devices: int) -> int:
  """``rows`` rounded up to whole buckets on each of ``devices`` devices."""
  unit = bucket * devices
  return -(-max(rows, 1) // unit) * unit


def sized(schema: Schema, bucket: int, devices: int) -> Schema:
  """``schema`` with each dynamic column's capacity the rows of its table on ``devices`` devices.

  Each device owns whole buckets of a dynamic table, so its rows round up to
  whole buckets on every device. A run sizes its schema on its own devices
  and saves it: a restore from the saved schema (an export, on one device)
  then builds the tables its checkpoint holds, where rounding again for its
  own device count would build smaller ones.

  >>> s = Schema((schema_lib.Column("u", schema_lib.USER_ID, schema_lib.STRING,
  ...                               ids=schema_lib.DYNAMIC, num_embeddings=128),))
  >>> sized(s, 128, 8)["u"].num_embeddings, sized(sized(s, 128, 8), 128, 1)["u"].num_embeddings
  (1024, 1024)
  """
  for name in schema.features():
    c = schema[name]
    rows = _capacity(c.num_embeddings, bucket, devices)
    if c.ids == schema_lib.DYNAMIC and rows != c.num_embeddings:
      schema = schema.replace(name, num_embeddings=rows)
  return schema


def _embed_init(model_config) -> dict:
  """``TableSpec``'s initializer from ``embed_init_std`` (0 or absent: the table's default).

  Raises:
    ValueError: a negative ``embed_init_std``.
  """
  std = float(model_config.get("embed_init_std") or 0.0)
  if std < 0:
    raise ValueError(f"config.model.embed_init_std={std} must be >= 0 (0: the tables' default "
                     "initializer, normal with variance 1 / embed_dim).")
  return {"initializer": jax.nn.initializers.normal(std)} if std else {}


def tables_and_features(model_config, schema: Schema, mesh, width: int,
                        entity: str | None = None):
  """``(tables, features)`` of the schema's id columns (of ``entity``, if given).

  Raises:
    ValueError: a dynamic table's settings can't work (names the key).
  """
  dyn = model_config.get("dynamic") or {}
  init = _embed_init(model_config)
  tables, features = [], []
  for name in schema.features(entity):
    c = schema[name]
    if c.ids == schema_lib.DYNAMIC:
      bucket = bucket_size(model_config)
      eviction = dyn.get("eviction", "lru")
      spec = DynamicSpec(admit_after=dyn.get("admit_after", 1), bucket_size=bucket,
                         eviction=None if eviction in ("none", None) else eviction,
                         decay_every=dyn.get("decay_every", 0),
                         default=dyn.get("default", "zero"))
      devices = 1 if mesh is None else mesh.size
      tables.append(TableSpec(name, _capacity(c.num_embeddings, bucket, devices), width,
                              dynamic=spec))
    else:
      tables.append(TableSpec(name, c.num_embeddings, width, **init))
    single = c.role != schema_lib.LIST
    features.append(FeatureSpec(name, name, combiner=model_config.combiner,
                                max_ids_per_sample=1 if single else c.max_len))
  return tables, features


def _collection_kwargs(model_config, mesh, batch_size: int) -> dict:
  return dict(mesh=mesh, layout=CollectionLayout(
      kernel=model_config.kernel, num_unique=model_config.num_unique,
      replicate_below_bytes=model_config.get("replicate_below_bytes"), batch_size=batch_size))


class FeatureTransformer(nnx.Module):
  """A row's features as tokens of a transformer, read out through a learned token.

  Each id feature's (pooled) row is a token, as is each dense column (its
  value times a learned vector, plus a learned bias: the FT-Transformer's
  numerical tokens); attention runs over all of them and a learned
  read-out token, whose output goes through an MLP to the logits.

  >>> from flax import nnx
  >>> from embedlib import FeatureSpec, TableSpec
  >>> m = FeatureTransformer(num_dense=2, tables=[TableSpec("a", 10, 8)],
  ...     features=[FeatureSpec("a", "a", max_ids_per_sample=1)], width=8, num_layers=1,
  ...     num_heads=2, mlp_ratio=2, num_outputs=1, rngs=nnx.Rngs(0))
  >>> m(jnp.ones((3, 2)), {"a": jnp.array([1, 2, 3])}).shape
  (3,)
  """

  def __init__(self, *, num_dense: int, tables, features, width: int, num_layers: int,
               num_heads: int, mlp_ratio: int, num_outputs: int, rngs: nnx.Rngs,
               **collection_kwargs):
    self.feature_names = tuple(f.name for f in features)
    self.embeddings = EmbeddingCollection(tables, features, rngs=rngs, **collection_kwargs)
    init = nnx.initializers.normal(0.02)
    self.dense_scale = nnx.Param(init(rngs.params(), (max(num_dense, 1), width)))
    self.dense_bias = nnx.Param(jnp.zeros((max(num_dense, 1), width)))
    self.readout = nnx.Param(init(rngs.params(), (1, 1, width)))
    self.trunk = Transformer(width, num_layers=num_layers, num_heads=num_heads,
                             mlp_ratio=mlp_ratio, rngs=rngs)
    self.head = MLP(width, (width, num_outputs), rngs=rngs)
    self.num_dense, self.num_outputs = num_dense, num_outputs

  def __call__(self, dense, sparse, weights=None) -> jax.Array:
    """Logits ``[batch]`` (``[batch, num_outputs]`` for several labels)."""
    embedded = self.embeddings(sparse, weights)
    b = dense.shape[0]
    tokens = [jnp.broadcast_to(self.readout[...], (b, 1, self.readout.shape[-1]))]
    if self.feature_names:
      tokens.append(jnp.stack([embedded[n] for n in self.feature_names], axis=1))
    if self.num_dense:
      tokens.append(dense[:, :, None] * self.dense_scale[...] + self.dense_bias[...])
    x = jnp.concatenate([t.astype(jnp.float32) for t in tokens], axis=1)
    mask = jnp.ones((b, 1, x.shape[1], x.shape[1]), bool)
    out = self.head(self.trunk(x, mask)[:, 0])
    return out[:, 0] if self.num_outputs == 1 else out


class TableTwoTower(nnx.Module):
  """User and item towers over a table's columns, scored by a scaled dot product.

  The user tower reads the user's columns and the row's own (context: the
  columns of no entity); the item tower the item's. Each pools its id
  features (one collection holds every table), concatenates them with its
  dense columns and ends in an MLP of ``sizes``, L2-normalised.

  Args:
    schema: the resolved schema (it must have an item id column).
    tables, features: every id column's table and feature (one collection).
    sizes: each tower's MLP widths; the last is the embedding width.
    temperature: the scores' temperature, learned within
      ``[min_temperature, max_temperature]``.
  """

  def __init__(self, *, schema: Schema, tables, features, sizes, temperature: float = 0.05,
               min_temperature: float = 0.01, max_temperature: float = 1.0, mesh=None,
               rngs: nnx.Rngs, **collection_kwargs):
    check_temperature(temperature, min_temperature, max_temperature)
    item = schema.features("item")
    self.item_features = item
    self.user_features = tuple(n for n in schema.features() if n not in item)
    dense = schema.dense()
    self.item_dense = tuple(i for i, n in enumerate(dense) if schema[n].entity == "item")
    self.user_dense = tuple(i for i, n in enumerate(dense) if schema[n].entity != "item")
    self.embeddings = EmbeddingCollection(tables, features, mesh=mesh, rngs=rngs,
                                          **collection_kwargs)
    widths = {t.name: t.features for t in tables}
    user_in = sum(widths[n] for n in self.user_features) + len(self.user_dense)
    item_in = sum(widths[n] for n in self.item_features) + len(self.item_dense)
    self.user_mlp = MLP(user_in, tuple(sizes), rngs=rngs)
    self.item_mlp = MLP(item_in, tuple(sizes), rngs=rngs)
    self.log_temperature = nnx.Param(jnp.log(jnp.float32(temperature)))
    self.min_temperature, self.max_temperature = min_temperature, max_temperature
    self.mesh = mesh
    self.features = sizes[-1]

  def temperature(self) -> jax.Array:
    return jnp.clip(jnp.exp(self.log_temperature[...]), self.min_temperature,
                    self.max_temperature)

  def _tower(self, mlp, names, dense_index, embedded, dense):
    parts = [embedded[n].astype(jnp.float32) for n in names]
    if dense_index:
      parts.append(dense[:, jnp.asarray(dense_index)])
    return l2_normalize(mlp(jnp.concatenate(parts, axis=-1)))

  def towers(self, dense, sparse, weights=None) -> tuple[jax.Array, jax.Array]:
    """``(users [B, features], items [B, features])`` of a batch of rows."""
    embedded = self.embeddings(sparse, weights)
    return (self._tower(self.user_mlp, self.user_features, self.user_dense, embedded, dense),
            self._tower(self.item_mlp, self.item_features, self.item_dense, embedded, dense))


def build_tabular(model_config, schema: Schema, *, mesh=None, batch_size: int = 4096,
                  rngs: nnx.Rngs):
  """The model ``config.model.name`` names, its inputs the schema's columns.

  Config keys: ``name``; ``embed_dim`` (every table's width; the ranker's
  is ``width``), ``embed_init_std`` (the standard deviation of a vocab or
  hashed table's normal initial rows; 0: ``TableSpec``'s default, variance
  1 / width), ``combiner``, ``kernel``, ``num_unique``,
  ``replicate_below_bytes``, ``dynamic`` (the dynamic tables' settings but
  their capacity: ``bucket_size``, ``admit_after``, ``eviction``,
  ``decay_every``, ``default``); DLRM and DCN: ``bottom_sizes``,
  ``top_sizes`` (ending in 1), ``cross_layers``; ranker: ``width``,
  ``num_layers``, ``num_heads``, ``mlp_ratio``; two towers: ``tower_sizes``
  (the last is the embedding width), ``temperature``.

  Raises:
    ValueError: naming the config key (or schema column) that can't work.
  """
  name = model_config.name
  if name not in NAMES:
    raise ValueError(f"config.model.name={name!r}; a table's rows train one of {NAMES}.")
  labels = len(schema.labels())
  if name == TWO_TOWER:
    if schema.role_column(schema_lib.ITEM_ID) is None:
      raise ValueError("config.model.name='two_tower' needs an item id column to tell items "
                       "apart; name it with config.data.item_id.")
    tables, features = tables_and_features(model_config, schema, mesh, model_config.embed_dim)
    kw = _collection_kwargs(model_config, mesh, batch_size)
    del kw["mesh"]
    return TableTwoTower(schema=schema, tables=tables, features=features,
                         sizes=tuple(model_config.tower_sizes), mesh=mesh,
                         temperature=model_config.temperature, rngs=rngs, **kw)
  if not labels:
    raise ValueError(f"config.model.name={name!r} predicts labels; name the label column(s) "
                     "with config.data.label.")
  kw = _collection_kwargs(model_config, mesh, batch_size)
  if name == "ranker":
    tables, features = tables_and_features(model_config, schema, mesh, model_config.width)
    return FeatureTransformer(num_dense=len(schema.dense()), tables=tables, features=features,
                              width=model_config.width, num_layers=model_config.num_layers,
                              num_heads=model_config.num_heads,
                              mlp_ratio=model_config.mlp_ratio, num_outputs=labels, rngs=rngs,
                              **kw)
  dim = model_config.embed_dim
  tables, features = tables_and_features(model_config, schema, mesh, dim)
  top = tuple(model_config.top_sizes)
  if top[-1:] != (1,):
    raise ValueError(f"config.model.top_sizes={top} must end in 1 (a logit a label).")
  return DLRM(num_dense=len(schema.dense()), tables=tables, features=features,
              bottom_sizes=tuple(model_config.bottom_sizes) + (dim,),
              top_sizes=top[:-1] + (labels,), interaction=DOT if name == "dlrm" else CROSS,
              cross_layers=model_config.cross_layers, rngs=rngs, **kw)
