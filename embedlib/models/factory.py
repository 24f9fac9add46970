"""The one place a config becomes a model (house rule 3): one builder per family.

- ``dlrm`` / ``dcn``: the DLRM family on an ``EmbeddingCollection``.
- ``ranker``: the transformer ranker with candidate isolation.
- ``two_tower``: two-tower retrieval.
- ``sasrec`` / ``hstu``: next-item encoders over a user's recent items, with
  the item table tied to the output.

``hashers(model_config)`` gives the ``MultiHash`` functions a model's
embeddings expect, so the data path hashes ids exactly as the model was
built to read them.
"""

from __future__ import annotations

from flax import nnx

from embedlib.collection import DynamicSpec, FeatureSpec, TableSpec
from embedlib.data.multi_hash import MultiHash
from embedlib.data.next_item import NextItemSpec
from embedlib.data.sequences import SequenceSpec
from embedlib.data.spec import DataSpec
from embedlib.dynamic import DynamicEmbed
from embedlib.embed import ShardedEmbed
from embedlib.models import two_tower as two_tower_lib
from embedlib.models.dlrm import CROSS, DLRM, DOT
from embedlib.models.hstu import HSTU
from embedlib.models.multi_hash_embed import MultiHashEmbed
from embedlib.models.next_item import ItemColumns
from embedlib.models.ranker import RankerTrunk, TransformerRanker
from embedlib.models.sasrec import SASRec
from embedlib.plan import CollectionLayout, Layout

#: config.model.name -> interaction of the DLRM family.
_FAMILY = {"dlrm": DOT, "dcn": CROSS}
RANKER = "ranker"
TWO_TOWER = "two_tower"
SASREC = "sasrec"
HSTU_NAME = "hstu"
NEXT_ITEM = (SASREC, HSTU_NAME)
#: The hashed entities of each sequence model (config.model.<entity>_hash).
_HASHED = {RANKER: ("user",), TWO_TOWER: ("user", "item")}
NAMES = tuple(_FAMILY) + (RANKER, TWO_TOWER) + NEXT_ITEM


def hashers(model_config) -> dict[str, MultiHash]:
  """``{entity: MultiHash}`` for each hashed entity of the model (none for DLRM).

  Raises:
    ValueError: a hash setting can't work (names ``config.model.<entity>_hash``).
  """
  out = {}
  for entity in _HASHED.get(model_config.name, ()):
    cfg = model_config[f"{entity}_hash"]
    out[entity] = MultiHash(cfg.num_buckets, cfg.num_hashes, cfg.seed,
                            name=f"config.model.{entity}_hash")
  return out


#: config.model.dynamic keys, in the order their errors are matched.
_DYNAMIC_KEYS = ("capacity", "admit_after", "eviction", "bucket_size", "decay_every", "default")


def _dynamic_spec(cfg, where: str, name: str, fallback: int) -> tuple[DynamicSpec, int]:
  """``(DynamicSpec, capacity)`` of one settings dict; errors name ``<where>.<key>``."""
  eviction = cfg.get("eviction", "lru")
  try:
    spec = DynamicSpec(
        admit_after=cfg.get("admit_after", 1),
        eviction=None if eviction in ("none", None) else eviction,
        bucket_size=cfg.get("bucket_size", 128), decay_every=cfg.get("decay_every", 0),
        default=cfg.get("default", "zero"))
    capacity = cfg.get("capacity", 0) or fallback
    TableSpec(name, capacity, 1, dynamic=spec)  # checks capacity against bucket_size
    return spec, capacity
  except (TypeError, ValueError) as e:
    msg = str(e)
    key = next((k for k in _DYNAMIC_KEYS if f"{k}=" in msg), "capacity")
    if key == "eviction":
      msg = msg.replace("None (a full", "'none' (a full")
    raise ValueError(f"{where}.{key}: {msg}") from None


def dynamic_tables(model_config, data_spec) -> list[TableSpec]:
  """The DLRM family's tables as dynamic ones (raw ids), set by ``config.model.dynamic``.

  ``capacity`` (0: each feature's ``num_embeddings``, i.e.
  ``config.data.table_sizes``), ``bucket_size``, ``admit_after``,
  ``eviction`` (``"lru" | "lfu" | "none"``), ``decay_every`` and
  ``default`` (``"zero" | "learned"``): see ``embedlib.DynamicEmbed``.

  Raises:
    ValueError: naming the ``config.model.dynamic`` key that can't work.
  """
  cfg = model_config.get("dynamic")
  if cfg is None:
    raise ValueError("config.model.dynamic: raw ids (config.data.raw_ids=True) need the "
                     "dynamic tables' settings; add config.model.dynamic (see "
                     "configs/dlrm_criteo.py), or set config.data.raw_ids=False.")
  out = []
  for f in data_spec.features:
    spec, capacity = _dynamic_spec(cfg, "config.model.dynamic", f.name, f.num_embeddings)
    out.append(TableSpec(f.name, capacity, model_config.embed_dim, dynamic=spec))
  return out


#: The tables of the request models that may be dynamic (read by raw ids).
REQUEST_DYNAMIC = ("user", "item")


def request_dynamic(model_config) -> dict[str, tuple[DynamicSpec, int]]:
  """The ranker's and two towers' dynamic tables: ``{table: (DynamicSpec, capacity)}``.

  ``config.model.dynamic.<table>`` for ``table`` in ``("user", "item")``
  holds one table's settings (the keys of ``dynamic_tables``; ``capacity``
  is required). A table named there is an ``embedlib.DynamicEmbed`` read by
  raw ids; the item table must be one, a user table left out hashes the raw
  user ids (``config.model.user_hash``).

  Raises:
    ValueError: naming the ``config.model.dynamic`` key that can't work.
  """
  cfg = model_config.get("dynamic") or {}
  name = model_config.name
  out = {}
  for table, settings in cfg.items():
    where = f"config.model.dynamic.{table}"
    if table not in REQUEST_DYNAMIC or not hasattr(settings, "get"):
      raise ValueError(f"{where}: config.model.name={name!r} has no dynamic table {table!r}; "
                       f"its tables read by raw ids are {REQUEST_DYNAMIC}, each a dict of "
                       "capacity, bucket_size, admit_after, eviction, decay_every, default. "
                       "Remove the key or rename it.")
    if not settings.get("capacity", 0):
      raise ValueError(f"{where}.capacity: give the table's rows (a multiple of bucket_size "
                       "times the devices), e.g. twice the distinct ids expected.")
    out[table] = _dynamic_spec(settings, where, table, 0)
  if "item" not in out:
    raise ValueError(f"config.model.dynamic.item: config.model.name={name!r} reads raw item "
                     "ids (config.data.raw_ids=True) through a dynamic item table, whose "
                     "resident rows are also what an eval ranks; add "
                     "config.model.dynamic.item (see configs/movielens.py), or set "
                     "config.data.raw_ids=False.")
  return out


def _dynamic_embed(model_config, table, found, features, mesh, rngs):
  """``DynamicEmbed`` of ``found[table]``; a capacity the mesh can't split names its key."""
  spec, capacity = found[table]
  try:
    return DynamicEmbed(capacity, features, dynamic=spec, mesh=mesh, name=table, rngs=rngs)
  except ValueError as e:
    key = ".capacity" if "devices own whole buckets" in str(e) else ""
    raise ValueError(f"config.model.dynamic.{table}{key}: {e}") from None


def build_model(model_config, data_spec, *, mesh=None, batch_size: int = 4096,
                dynamic: bool = False, rngs: nnx.Rngs):
  """Builds the model named by ``model_config.name`` for a dataset layout.

  The DLRM family gets one table per categorical feature of a ``DataSpec``
  (single-hot features declared with ``max_ids_per_sample=1``, multi-hot
  ones pooled with ``model_config.combiner``); the sequence models are
  sized by a ``SequenceSpec`` (``build_ranker``, ``build_two_tower``).

  >>> import ml_collections
  >>> from flax import nnx
  >>> from embedlib.data.spec import DataSpec, SparseFeature
  >>> cfg = ml_collections.ConfigDict(dict(name="dlrm", embed_dim=8,
  ...     bottom_sizes=(16,), top_sizes=(16, 1), combiner="sum",
  ...     num_unique=None, kernel="auto", cross_layers=2))
  >>> spec = DataSpec(4, (SparseFeature("a", 100), SparseFeature("b", 10, bag_size=3)))
  >>> type(build_model(cfg, spec, rngs=nnx.Rngs(0))).__name__
  'DLRM'

  Args:
    model_config: ``name`` (``"dlrm" | "dcn" | "ranker" | "two_tower" |
      "sasrec" | "hstu"``); for
      DLRM and DCN: ``embed_dim``,
      ``bottom_sizes`` (hidden layers; the bottom MLP ends in ``embed_dim``),
      ``top_sizes`` (ending in 1), ``combiner``, ``num_unique`` (None, a
      capacity, or ``"auto"``), ``kernel``, ``cross_layers``, and
      optionally ``replicate_below_bytes`` and ``id_skew`` (how much each
      table's ids repeat, for the plan's dedup: ``id_skews``).
    data_spec: the dataset layout (dense width, categorical features).
    mesh: the device mesh, or None for one device.
    batch_size: global batch, for the plan's traffic estimates.
    dynamic: raw ids: the DLRM family's tables are dynamic
      (``dynamic_tables``), the ranker's and two towers' tables named
      in ``config.model.dynamic`` (``request_dynamic``), and the next-item
      models' tied item table (``next_item_dynamic``).
    rngs: random number generators.

  Returns:
    The model.
  """
  name = model_config.name
  if name not in NAMES:
    raise ValueError(f"config.model.name={name!r}; use one of {NAMES}.")
  if name in NEXT_ITEM:
    if not isinstance(data_spec, NextItemSpec):
      raise ValueError(f"config.model.name={name!r} reads next-item batches (a NextItemSpec), "
                       f"not {type(data_spec).__name__}; use the sequential task.")
    return build_next_item(model_config, data_spec, mesh=mesh, batch_size=batch_size,
                           dynamic=dynamic, rngs=rngs)
  if name in (RANKER, TWO_TOWER):
    if not isinstance(data_spec, SequenceSpec):
      raise ValueError(f"config.model.name={name!r} reads request batches (a SequenceSpec), "
                       f"not {type(data_spec).__name__}; use the ranking or retrieval task.")
    build = build_ranker if name == RANKER else build_two_tower
    return build(model_config, data_spec, mesh=mesh, batch_size=batch_size, dynamic=dynamic,
                 rngs=rngs)
  if not isinstance(data_spec, DataSpec):
    raise ValueError(f"config.model.name={name!r} reads click batches (a DataSpec); use the "
                     "ctr task.")
  dim = model_config.embed_dim
  if dynamic:
    tables = dynamic_tables(model_config, data_spec)
  else:
    skews = id_skews(model_config, data_spec)
    tables = [TableSpec(f.name, f.num_embeddings, dim, id_skew=skews[f.name])
              for f in data_spec.features]
  features = [
      FeatureSpec(f.name, f.name, combiner=model_config.combiner,
                  max_ids_per_sample=1 if f.bag_size == 1 else None)
      for f in data_spec.features
  ]
  try:
    return _dlrm(model_config, data_spec, tables, features, name, dim, mesh, batch_size, rngs)
  except ValueError as e:
    if dynamic and "devices own whole buckets" in str(e):
      raise ValueError(f"config.model.dynamic.capacity: {e}") from None
    raise


def id_skews(model_config, data_spec) -> dict[str, float]:
  """Each table's ``id_skew`` from ``model_config.id_skew``.

  None or 0: uniform ids; a number: every table's; a mapping: by table
  (feature) name, the rest 0. ``"fit"`` is resolved by ``python -m train``
  from a batch of the run's ids (``embedlib.training.setup.fitted_id_skews``)
  before the model is built.
  """
  names = [f.name for f in data_spec.features]
  given = model_config.get("id_skew")
  if given is None:
    return dict.fromkeys(names, 0.0)
  if hasattr(given, "items"):
    unknown = sorted(set(given.keys()) - set(names))
    if unknown:
      raise ValueError(f"config.model.id_skew names table {unknown[0]!r}, which is not among "
                       f"the data's features {tuple(names)}.")
    return {n: given.get(n, 0.0) for n in names}
  if isinstance(given, str):
    raise ValueError(
        f"config.model.id_skew={given!r}: python -m train fits 'fit' from the first training "
        "batch; building a model yourself, pass a number (a Zipf exponent; 0: uniform ids) "
        "or {table: number}, e.g. from embedlib.collection.fit_id_skews.")
  return dict.fromkeys(names, given)


def _dlrm(model_config, data_spec, tables, features, name, dim, mesh, batch_size, rngs):
  return DLRM(
      num_dense=data_spec.num_dense,
      tables=tables,
      features=features,
      bottom_sizes=tuple(model_config.bottom_sizes) + (dim,),
      top_sizes=tuple(model_config.top_sizes),
      interaction=_FAMILY[name],
      cross_layers=model_config.cross_layers,
      mesh=mesh,
      layout=CollectionLayout(
          num_unique=model_config.num_unique, kernel=model_config.kernel,
          replicate_below_bytes=model_config.get("replicate_below_bytes"),
          batch_size=batch_size),
      rngs=rngs,
  )


def _tables(model_config, mesh, **layout):
  """``ShardedEmbed`` keyword arguments shared by a model's tables; ``layout``: more ``Layout``."""
  return dict(mesh=mesh, layout=Layout(
      kernel=model_config.kernel,
      replicate_below_bytes=model_config.get("replicate_below_bytes"), **layout))


def _requests_per_device(batch_size: int, mesh) -> int:
  """Requests one device holds: the batch is split over every device of the mesh."""
  return -(-batch_size // (1 if mesh is None else mesh.size))


def _user(model_config, hasher, out_features, mesh, batch_size, rngs):
  cfg = model_config.user_hash
  ids = _requests_per_device(batch_size, mesh) * hasher.num_hashes
  return MultiHashEmbed(hasher, cfg.features, combiner=cfg.combiner, out_features=out_features,
                        name="user", rngs=rngs, **_tables(model_config, mesh, ids_per_device=ids))


def _trunk(model_config, spec: SequenceSpec, items, authors, user, rngs):
  return RankerTrunk(items=items, authors=authors, user=user, num_actions=spec.num_actions,
                     history_len=spec.history_len, width=model_config.width,
                     num_layers=model_config.num_layers, num_heads=model_config.num_heads,
                     mlp_ratio=model_config.mlp_ratio,
                     action_features=model_config.action_features,
                     causal=model_config.causal, rngs=rngs)


def build_ranker(model_config, spec: SequenceSpec, *, mesh=None, batch_size: int = 4096,
                 dynamic: bool = False, rngs: nnx.Rngs):
  """``TransformerRanker``: item and author tables (ids), a multi-hash user embedding.

  Config keys: ``width``, ``num_layers``, ``num_heads``, ``mlp_ratio``,
  ``causal``, ``item_features``, ``author_features``, ``action_features``,
  ``user_hash`` (``num_buckets``, ``num_hashes``, ``features``,
  ``combiner``, ``seed``), ``kernel``, ``replicate_below_bytes``. The
  tables are planned for ``batch_size`` requests split over the mesh, the
  history's ids being each step's largest lookup. With ``dynamic`` (raw
  ids) the item table, and the user's if named, are ``DynamicEmbed`` tables
  of ``config.model.dynamic`` (``request_dynamic``); a dynamic user row is
  ``width`` wide.
  """
  found = request_dynamic(model_config) if dynamic else {}
  # The history's lookup is the largest a step makes (candidates are fewer).
  history_ids = _requests_per_device(batch_size, mesh) * spec.history_len
  tables = _tables(model_config, mesh, ids_per_device=history_ids)
  if "item" in found:
    items = _dynamic_embed(model_config, "item", found, model_config.item_features, mesh, rngs)
  else:
    items = ShardedEmbed(spec.num_items, model_config.item_features, name="item", rngs=rngs,
                         **tables)
  authors = ShardedEmbed(spec.num_authors, model_config.author_features, name="author",
                         rngs=rngs, **tables)
  if "user" in found:  # the user token: its row is the transformer's width
    user = _dynamic_embed(model_config, "user", found, model_config.width, mesh, rngs)
  else:
    user = _user(model_config, hashers(model_config)["user"], model_config.width, mesh,
                 batch_size, rngs)
  trunk = _trunk(model_config, spec, items, authors, user, rngs)
  return TransformerRanker(trunk, rngs=rngs)


def build_two_tower(model_config, spec: SequenceSpec, *, mesh=None, batch_size: int = 4096,
                    dynamic: bool = False, rngs: nnx.Rngs):
  """``TwoTower``: multi-hash items (shared by the towers), author table, a user tower.

  Config keys: ``user_tower`` (``"pooled" | "trunk"``), ``features`` (the
  embedding width), ``tower_sizes`` (hidden widths of both MLPs),
  ``temperature``, ``min_temperature``, ``max_temperature``,
  ``learn_temperature``, ``item_hash`` and ``user_hash`` (as the ranker's
  ``user_hash``), ``author_features``, ``action_features``, and for the
  trunk tower the ranker's transformer keys. With ``dynamic`` (raw ids)
  the item table, and the user's if named, are ``DynamicEmbed`` tables of
  ``config.model.dynamic``, ``item_hash.features`` (``user_hash.features``,
  or ``width`` for the trunk tower) wide.
  """
  if model_config.user_tower not in two_tower_lib.USER_TOWERS:
    raise ValueError(f"config.model.user_tower={model_config.user_tower!r}; use one of "
                     f"{two_tower_lib.USER_TOWERS}.")
  two_tower_lib.check_temperature(model_config.temperature, model_config.min_temperature,
                                  model_config.max_temperature)
  found = hashers(model_config)
  raw = request_dynamic(model_config) if dynamic else {}
  cfg = model_config.item_hash
  # The history's lookup is the largest a training step makes.
  history_ids = _requests_per_device(batch_size, mesh) * spec.history_len
  if "item" in raw:  # the item's row is as wide as its multi-hash embedding would be
    items = _dynamic_embed(model_config, "item", raw, cfg.features, mesh, rngs)
  else:
    items = MultiHashEmbed(
        found["item"], cfg.features, combiner=cfg.combiner, name="item", rngs=rngs,
        **_tables(model_config, mesh, ids_per_device=history_ids * found["item"].num_hashes))
  authors = ShardedEmbed(spec.num_authors, model_config.author_features, name="author",
                         rngs=rngs, **_tables(model_config, mesh, ids_per_device=history_ids))
  sizes = tuple(model_config.tower_sizes) + (model_config.features,)
  trunk = model_config.user_tower == two_tower_lib.TRUNK

  def user_embed(width):
    if "user" in raw:
      return _dynamic_embed(model_config, "user", raw, width or model_config.user_hash.features,
                            mesh, rngs)
    return _user(model_config, found["user"], width, mesh, batch_size, rngs)

  if trunk:
    user = user_embed(model_config.width)
    tower = two_tower_lib.TrunkUserTower(
        _trunk(model_config, spec, items, authors, user, rngs), model_config.features,
        rngs=rngs)
  else:
    user = user_embed(None)
    tower = two_tower_lib.PooledUserTower(
        items=items, authors=authors, user=user, num_actions=spec.num_actions, sizes=sizes,
        action_features=model_config.action_features, rngs=rngs)
  return two_tower_lib.TwoTower(
      items=items, authors=authors, user_tower=tower, candidate_sizes=sizes,
      temperature=model_config.temperature, min_temperature=model_config.min_temperature,
      max_temperature=model_config.max_temperature,
      learn_temperature=model_config.learn_temperature, mesh=mesh, rngs=rngs)


def next_item_dynamic(model_config) -> dict[str, tuple[DynamicSpec, int]]:
  """SASRec's and HSTU's dynamic item table: ``{"item": (DynamicSpec, capacity)}``.

  ``config.model.dynamic.item`` holds its settings (the keys of
  ``dynamic_tables``; ``capacity`` is required, ``default`` must be
  ``"zero"``). The table is tied to the output and trains with the dense
  optimizer; the rows it places get fresh dense optimizer slots
  (``embedlib.dynamic.reset_slots``), so any eviction works.

  Raises:
    ValueError: naming the ``config.model.dynamic`` key that can't work.
  """
  cfg = model_config.get("dynamic") or {}
  extra = sorted(set(cfg) - {"item"})
  if extra:
    raise ValueError(f"config.model.dynamic.{extra[0]}: config.model.name="
                     f"{model_config.name!r} has no dynamic table {extra[0]!r}; its one "
                     "table read by raw ids is 'item'. Remove the key.")
  found = request_dynamic(model_config)
  if found["item"][0].default != "zero":
    raise ValueError("config.model.dynamic.item.default: a next-item model reads a history "
                     "item that is not resident as padding and ranks resident rows only, so "
                     "a learned default row would never be read; use default='zero'.")
  return found


def build_next_item(model_config, spec: NextItemSpec, *, mesh=None, batch_size: int = 4096,
                    dynamic: bool = False, rngs: nnx.Rngs):
  """``SASRec`` or ``HSTU`` over a tied item table of ``num_items + 1`` rows (0 pads).

  Config keys: ``width`` (the item rows' and the model's), ``num_layers``,
  ``num_heads``, ``scale_embeddings``, ``repeat_bias``, for SASRec ``mlp_ratio``, for HSTU
  ``num_time_buckets``; ``kernel``, ``replicate_below_bytes``. The table
  is planned as an output layer (``tied``) for ``batch_size`` rows of
  ``max_len`` items split over the mesh. With ``dynamic`` (raw ids) it is
  a ``DynamicEmbed`` of ``config.model.dynamic.item`` (``next_item_dynamic``)
  whose rows are the output's.
  """
  ids = _requests_per_device(batch_size, mesh) * spec.max_len
  if dynamic:
    items = _dynamic_embed(model_config, "item", next_item_dynamic(model_config),
                           model_config.width, mesh, rngs)
  else:
    items = ShardedEmbed(spec.vocab_size, model_config.width, name="item", rngs=rngs,
                         **_tables(model_config, mesh, tied=True, ids_per_device=ids))
  side = None
  if spec.item_columns:  # the items' side columns, beside their ids
    side = ItemColumns(spec.item_columns, model_config.width, mesh=mesh, rngs=rngs)
  common = dict(max_len=spec.max_len, num_layers=model_config.num_layers,
                num_heads=model_config.num_heads,
                scale_embeddings=model_config.scale_embeddings,
                repeat_bias=model_config.repeat_bias, side=side, rngs=rngs)
  if model_config.name == SASREC:
    return SASRec(items, mlp_ratio=model_config.mlp_ratio, **common)
  return HSTU(items, num_time_buckets=model_config.num_time_buckets, **common)
