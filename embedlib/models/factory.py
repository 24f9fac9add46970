"""The one place a config becomes a model (house rule 3)."""

from __future__ import annotations

from flax import nnx

from embedlib.collection import FeatureSpec, TableSpec
from embedlib.data.spec import DataSpec
from embedlib.models.dlrm import CROSS, DLRM, DOT

#: config.model.name -> interaction of the DLRM family.
_FAMILY = {"dlrm": DOT, "dcn": CROSS}


def build_model(model_config, data_spec: DataSpec, *, mesh=None,
                batch_size: int = 4096, rngs: nnx.Rngs):
  """Builds the model named by ``model_config.name`` for a dataset layout.

  One table per categorical feature, sized by the data spec; single-hot
  features are declared with ``max_ids_per_sample=1``, multi-hot ones pool
  with ``model_config.combiner``.

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
    model_config: ``name`` (``"dlrm" | "dcn"``), ``embed_dim``,
      ``bottom_sizes`` (hidden layers; the bottom MLP ends in ``embed_dim``),
      ``top_sizes`` (ending in 1), ``combiner``, ``num_unique``,
      ``kernel``, ``cross_layers``, and optionally ``replicate_below_bytes``.
    data_spec: the dataset layout (dense width, categorical features).
    mesh: the device mesh, or None for one device.
    batch_size: global batch, for the plan's traffic estimates.
    rngs: random number generators.

  Returns:
    The model.
  """
  name = model_config.name
  if name not in _FAMILY:
    raise ValueError(f"config.model.name={name!r}; use one of {tuple(_FAMILY)}.")
  dim = model_config.embed_dim
  tables = [TableSpec(f.name, f.num_embeddings, dim) for f in data_spec.features]
  features = [
      FeatureSpec(f.name, f.name, combiner=model_config.combiner,
                  max_ids_per_sample=1 if f.bag_size == 1 else None)
      for f in data_spec.features
  ]
  return DLRM(
      num_dense=data_spec.num_dense,
      tables=tables,
      features=features,
      bottom_sizes=tuple(model_config.bottom_sizes) + (dim,),
      top_sizes=tuple(model_config.top_sizes),
      interaction=_FAMILY[name],
      cross_layers=model_config.cross_layers,
      mesh=mesh,
      num_unique=model_config.num_unique,
      kernel=model_config.kernel,
      replicate_below_bytes=model_config.get("replicate_below_bytes"),
      batch_size=batch_size,
      rngs=rngs,
  )
