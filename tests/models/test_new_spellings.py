"""The library's own callers use the new spellings: nothing it builds warns of a deprecation.

Each config's model (the request models, the next-item models, the DLRM
family, the tabular models of every name) is built as its training run
builds it, under ``warnings.simplefilter("error", DeprecationWarning)``;
``nnx.eval_shape`` plans the tables without drawing them. A second test
reads the source of ``embedlib/``, ``notebooks/``, ``configs/``,
``benchmarks/`` and ``train/``: no table constructor is passed a keyword
that moved into ``layout=`` / ``dynamic=`` (``embedlib._deprecated``),
which also covers the benchmarks no test runs.
"""

import ast
import dataclasses
import importlib
import pathlib
import warnings

import jax
import pytest
from flax import nnx

from configs import movielens as movielens_config
from configs import quickstart as quickstart_config
from configs import ranker as ranker_config
from configs import tabular as tabular_config
from configs import two_tower as two_tower_config
from embedlib import CollectionLayout, DynamicSpec, Layout, notebook
from embedlib.data.next_item import NextItemSpec
from embedlib.data.sequences import SequenceSpec
from embedlib.data.spec import DataSpec, SparseFeature
from embedlib.models import build_model
from embedlib.models.tabular import build_tabular
from embedlib.tabular import schema as s

ROOT = pathlib.Path(__file__).resolve().parents[2]
SEQUENCES = SequenceSpec(num_items=500, num_authors=20, history_len=6, num_candidates=5)
NEXT_ITEMS = NextItemSpec(num_items=50, max_len=6)
SCHEMA = s.Schema((
    s.Column("user_id", s.USER_ID, s.STRING, ids=s.DYNAMIC, num_embeddings=128),
    s.Column("item_id", s.ITEM_ID, s.INT, ids=s.HASHED, num_embeddings=64),
    s.Column("genres", s.LIST, s.INT, entity="item", ids=s.HASHED, num_embeddings=16, max_len=3),
    s.Column("price", s.DENSE, s.FLOAT),
    s.Column("clicked", s.LABEL, s.INT),
))


def _model_config(module, arg, **overrides):
  config = module.get_config(arg).model
  config.update(overrides)
  return config


#: (name, build(mesh)) of every model a config trains.
BUILDS = [
    ("quickstart dlrm", lambda mesh: build_model(
        _model_config(quickstart_config, "smoke"),
        DataSpec(2, (SparseFeature("a", 100), SparseFeature("b", 10, bag_size=3))),
        mesh=mesh, batch_size=64, rngs=nnx.Rngs(0))),
    ("ranker", lambda mesh: build_model(_model_config(ranker_config, "smoke"), SEQUENCES,
                                        mesh=mesh, batch_size=64, rngs=nnx.Rngs(0))),
    ("two towers", lambda mesh: build_model(_model_config(two_tower_config, "smoke"),
                                            SEQUENCES, mesh=mesh, batch_size=64,
                                            rngs=nnx.Rngs(0))),
] + [
    (f"movielens {name}, raw ids", lambda mesh, name=name: build_model(
        _model_config(movielens_config, f"smoke,{name}"),
        NEXT_ITEMS if name in ("sasrec", "hstu") else SEQUENCES,
        mesh=mesh, batch_size=64, dynamic=True, rngs=nnx.Rngs(0)))
    for name in ("sasrec", "hstu", "ranker", "two_tower")
] + [
    ("sasrec, ids", lambda mesh: build_model(
        _model_config(movielens_config, "smoke,sasrec"), NEXT_ITEMS, mesh=mesh,
        batch_size=64, rngs=nnx.Rngs(0))),
] + [
    (f"tabular {name}", lambda mesh, name=name: build_tabular(
        _model_config(tabular_config, "smoke,x.parquet", name=name), SCHEMA, mesh=mesh,
        batch_size=64, rngs=nnx.Rngs(0)))
    for name in ("dlrm", "dcn", "ranker", "two_tower")
]


@pytest.mark.parametrize("name, build", BUILDS, ids=[n for n, _ in BUILDS])
def test_the_configs_models_build_without_a_deprecation(name, build):
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  with warnings.catch_warnings():
    warnings.simplefilter("error", DeprecationWarning)
    model = nnx.eval_shape(lambda: build(mesh))
  assert isinstance(model, nnx.Module), name


def test_the_notebooks_setup_imports_without_a_deprecation():
  with warnings.catch_warnings():
    warnings.simplefilter("error", DeprecationWarning)
    importlib.reload(notebook)
    assert notebook.config_arg("full") in ("full", "smoke")


#: Keywords a table constructor accepts only through ``embedlib._deprecated``.
MOVED = ({f.name for cls in (Layout, CollectionLayout, DynamicSpec)
          for f in dataclasses.fields(cls)} | {"promote_dtype"})
TABLES = ("ShardedEmbed", "DynamicEmbed", "QuantizedEmbed", "EmbeddingCollection",
          "MultiHashEmbed")


def _old_spellings(path: pathlib.Path):
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if not isinstance(node, ast.Call):
      continue
    func = node.func
    called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    if called == "lookup_many":
      yield f"{path.relative_to(ROOT)}:{node.lineno}: lookup_many (use lookup_requests)"
    if called in TABLES:
      for k in node.keywords:
        if k.arg in MOVED:
          yield f"{path.relative_to(ROOT)}:{node.lineno}: {called}({k.arg}=...)"


def test_no_caller_in_the_repository_passes_a_moved_keyword():
  files = [p for d in ("embedlib", "notebooks", "configs", "benchmarks", "train")
           for p in sorted((ROOT / d).rglob("*.py"))]
  assert len(files) > 100
  found = [line for p in files for line in _old_spellings(p)]
  assert not found, ("these calls warn of a deprecation; move the keyword into "
                     "layout=embedlib.Layout(...) / CollectionLayout(...) or "
                     "dynamic=embedlib.DynamicSpec(...):\n" + "\n".join(found))
