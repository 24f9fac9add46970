"""Config errors name the feature or table; the plan picks and counts per table."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from embedlib import EmbeddingCollection, FeatureSpec, TableSpec
from embedlib.collection import estimate_bytes_moved, plan_collection

T = TableSpec("items", 20, 4)


def make(tables=(T,), features=(FeatureSpec("f", "items"),), **kw):
  return EmbeddingCollection(tables, features, rngs=nnx.Rngs(0), **kw)


@pytest.mark.parametrize("build,match", [
    (lambda: make(features=[FeatureSpec("clicks", "nope")]), "feature 'clicks' reads table 'nope'"),
    (lambda: make(tables=[T, T]), "table name 'items' is used 2 times"),
    (lambda: make(features=[FeatureSpec("f", "items")] * 2), "feature name 'f' is used 2 times"),
    (lambda: TableSpec("items", 0, 4), "table 'items': num_embeddings must be >= 1"),
    (lambda: TableSpec("items", 10, -2), "table 'items': features must be >= 1"),
    (lambda: FeatureSpec("tags", "items", max_ids_per_sample=0), "feature 'tags': max_ids_per_sample"),
    (lambda: FeatureSpec("tags", "items", combiner="max"), "feature 'tags': combiner='max'"),
    (lambda: TableSpec("items", 10, 4, sharding="rows"), "table 'items': sharding='rows'"),
    (lambda: make(tables=[T, TableSpec("unused", 5, 2)]), "table 'unused' is read by no feature"),
    (lambda: make(num_unique={"other": 4}), "num_unique names table 'other'"),
    (lambda: make(num_unique=0), "table 'items': num_unique must be an int >= 1"),
    (lambda: make(on_overflow="ignore"), "on_overflow='ignore'"),
    (lambda: TableSpec("items", 10, 4, sharding="table", column_axes="data"),
     r"table 'items': column_axes='data' .* only sharding='grid' .* never stacked"),
    (lambda: TableSpec("items", 10, 4, sharding="grid", column_axes=3),
     r"table 'items': column_axes=3; pass a mesh axis name"),
    (lambda: make(tables=[TableSpec("items", 20, 4, sharding="grid", column_axes="model")],
                  mesh={"data": 2, "model": 4}),
     r"items: axis 'model' is in both table_axes=\('model',\) \(rows\) and column_axes"),
    (lambda: make(tables=[TableSpec("items", 20, 4, sharding="grid")], mesh={"batch": 8}),
     r"items: sharding='grid' splits rows over table_axes and columns over column_axes"),
    (lambda: TableSpec("items", 10, 4, id_skew=-0.5),
     r"table 'items': id_skew must be a finite number >= 0 .*fit_id_skews"),
    (lambda: TableSpec("items", 10, 4, id_skew=float("nan")), r"table 'items': id_skew"),
    (lambda: TableSpec("items", 10, 4, id_skew="zipf"), r"table 'items': id_skew"),
])
def test_config_errors_raise_at_construction(build, match):
  with pytest.raises((ValueError, TypeError), match=match):
    build()


SINGLE = FeatureSpec("user", "items", max_ids_per_sample=1)
SEQ = FeatureSpec("history", "items", combiner=None)


@pytest.mark.parametrize("features,inputs,weights,match", [
    ([SINGLE], {"user": jnp.zeros((3, 2), int)}, None,
     r"feature 'user' is single-hot \(max_ids_per_sample=1\) but got a bag input of shape \(3, 2\)"),
    ([FeatureSpec("f", "items", max_ids_per_sample=2)], {"f": jnp.zeros((3, 5), int)}, None,
     "feature 'f' is limited"),
    ([FeatureSpec("f", "items")], {"f": (jnp.zeros(4, int), jnp.ones(2, int))}, None,
     "feature 'f': ragged ids need a static bag width"),
    ([FeatureSpec("f", "items", max_ids_per_sample=1)],
     {"f": (jnp.zeros(4, int), jnp.array([2, 2]))}, None, "feature 'f': .*max_bag=1"),
    ([SEQ], {"history": jnp.zeros((3, 2), int)}, {"history": jnp.ones((3, 2))},
     "feature 'history': weights were given for a sequence feature"),
    ([FeatureSpec("f", "items")], {"f": jnp.zeros((3, 2), int)}, {"f": jnp.ones((3, 3))},
     "feature 'f': weights shape"),
    ([FeatureSpec("f", "items")], {"f": jnp.zeros((3, 2, 2), int)}, None, "feature 'f': ids must be"),
    ([FeatureSpec("f", "items")], {"g": jnp.zeros(3, int)}, None, "inputs name feature 'g'"),
    ([FeatureSpec("f", "items"), SINGLE], {"f": jnp.zeros(3, int)}, None,
     "feature 'user' has no ids"),
    ([FeatureSpec("f", "items"), SINGLE], {"f": jnp.zeros(3, int), "user": jnp.zeros(4, int)},
     None, "feature 'user' has batch 4"),
])
def test_call_errors_name_the_feature(features, inputs, weights, match):
  coll = make(features=features)
  with pytest.raises(ValueError, match=match):
    coll(inputs, weights)


def test_plan_prints_one_row_per_table_and_sums_memory():
  tables = [TableSpec("tiny", 10, 16), TableSpec("wide", 4096, 128), TableSpec("tall", 1 << 16, 16)]
  feats = [FeatureSpec("a", "tiny"), FeatureSpec("b", "wide", max_ids_per_sample=8),
           FeatureSpec("c", "tall", max_ids_per_sample=4), FeatureSpec("d", "tall", combiner=None)]
  plan = plan_collection(tables, feats, mesh={"batch": 8}, batch_size=512, num_unique={"tall": 64})
  # "wide" looks up fewest bytes by hidden columns (a pooled row per sample),
  # but the sparse update would all-gather its full-width gradients.
  assert [t.plan.strategy for t in plan.tables] == ["replicated", "vocab", "routed"]
  assert plan.bytes_moved_update == sum(t.bytes_moved_update for t in plan.tables)
  assert plan["wide"].bytes_moved_update == plan["wide"].plan.sparse_update(512 // 8 * 8)[1]
  assert plan["tall"].features == ("c", "d")
  assert plan.bytes_per_device == sum(t.plan.bytes_per_device for t in plan.tables)
  # Dedup replaces the per-feature traffic of "tall" in the total.
  assert plan.bytes_moved == plan["wide"].bytes_moved + plan["tall"].bytes_moved_dedup
  text = str(plan).splitlines()
  assert text[0].startswith("EmbeddingCollection plan: 3 tables, mesh batch=8")
  rows = [line for line in text[1:] if not line.startswith(" ")]  # reasons are indented
  assert [line.split()[0] for line in rows] == ["table", "tiny", "wide", "tall", "total"]
  assert "update/step" in rows[0]
  assert "-" in rows[1] and plan["tiny"].bytes_moved == 0
  below = text[text.index(rows[2]) + 1]  # the reason starts below its row, indented
  assert below.startswith("    ") and plan["wide"].plan.reason.startswith(below.strip())


def _fit(text, width=100):
  too_wide = [line for line in text.splitlines() if len(line) > width]
  assert not too_wide, "\n".join(too_wide)


def test_printed_plans_fit_100_columns():
  # The Criteo config's tables (26 x 1M x 64) and batch, on 8 devices.
  criteo = plan_collection([TableSpec(f"C{i + 1}", 1_000_000, 64) for i in range(26)],
                           [FeatureSpec(f"C{i + 1}", f"C{i + 1}") for i in range(26)],
                           mesh={"batch": 8}, batch_size=8192,
                           num_unique={f"C{i + 1}": "auto" for i in range(26)})
  # Every layout, a stack of both placements, long names and long reasons.
  layouts = ["replicated", "vocab", "hidden", "routed", "auto", "table", "table", "table_row"]
  tables = [TableSpec(f"{kind}_table_with_a_long_descriptive_name_{i}", 4096 << i, 64,
                      sharding=kind) for i, kind in enumerate(layouts)]
  feats = [FeatureSpec(f"f{i}", t.name, max_ids_per_sample=8) for i, t in enumerate(tables)]
  every = plan_collection(tables, feats, mesh={"batch": 8}, batch_size=4096,
                          num_unique={tables[3].name: "auto"})
  assert {t.kind for t in every.tables} >= {"replicated", "vocab", "hidden", "routed", "table",
                                            "table_row"}
  for plan in (criteo, every):
    text = str(plan)
    _fit(text)
    for t in plan.tables:
      _fit(str(t.plan))
      note = t.plan.reason if t.stack is None else t.placed
      assert " ".join(note.split()) in " ".join(text.split())  # wrapped, not cut
  # A table the rows can't fit beside: its name takes a line of its own.
  named = every.tables[0].name
  assert any(line == named for line in str(every).splitlines())


def test_a_small_table_is_copied_only_where_its_gradients_move_less():
  # Both under the replicate threshold (1 MiB). A copy looks up for nothing
  # but all-reduces (or all-gathers) its gradients every step.
  tables = [TableSpec("tiny", 100, 64), TableSpec("mid", 4000, 64)]
  feats = [FeatureSpec("a", "tiny"), FeatureSpec("b", "mid")]
  plan = plan_collection(tables, feats, mesh={"batch": 8}, batch_size=4096)
  assert plan["tiny"].plan.strategy == "replicated"
  assert plan["tiny"].bytes_moved_update == plan["tiny"].plan.sparse_update(512)[1] > 0
  assert plan["mid"].plan.strategy == "routed"
  assert "a copy per device would move 910.00 KiB" in plan["mid"].plan.reason
  copy = plan_collection(tables, feats, mesh={"batch": 8}, batch_size=4096,
                         replicate_budget_bytes=2 << 20)["mid"]
  assert copy.plan.strategy == "replicated"  # a budget is the caller's word
  assert copy.bytes_moved_update > plan["mid"].bytes_moved + plan["mid"].bytes_moved_update


def test_pooled_feature_moves_pooled_rows_not_a_row_per_id():
  p = plan_collection([TableSpec("t", 1 << 16, 64, sharding="vocab")],
                      [FeatureSpec("f", "t")], mesh={"batch": 8}).tables[0].plan
  pooled = estimate_bytes_moved(p, [(16, True)], batch_size=1024)
  sequence = estimate_bytes_moved(p, [(16, False)], batch_size=1024)
  ids_only = estimate_bytes_moved(p, [(16, True)], batch_size=1024) - estimate_bytes_moved(
      p, [(1, True)], batch_size=1024)
  assert sequence > 8 * pooled  # 16 rows per sample vs one
  assert ids_only == 7 * (1024 * 15 // 8) * 4  # only the ids all-gather grows with the bag


def test_budget_replicates_the_tables_that_save_most_traffic_per_byte():
  tables = [TableSpec("hot", 4096, 32), TableSpec("cold", 4096, 32), TableSpec("big", 1 << 16, 32)]
  feats = [FeatureSpec("h", "hot", max_ids_per_sample=32), FeatureSpec("c", "cold"),
           FeatureSpec("b", "big", max_ids_per_sample=32)]
  kw = dict(mesh={"batch": 8}, batch_size=1024, replicate_below_bytes=0)
  per_table = plan_collection(tables, feats, **kw)
  assert all(t.plan.strategy != "replicated" for t in per_table.tables)
  budget = plan_collection(tables, feats, replicate_budget_bytes=4096 * 32 * 4, **kw)
  strategies = {t.name: t.plan.strategy for t in budget.tables}
  assert strategies["hot"] == "replicated"  # same bytes as "cold", more traffic saved
  assert strategies["cold"] != "replicated" and strategies["big"] != "replicated"
  assert "collection budget" in budget["hot"].plan.reason
  assert budget.bytes_moved < per_table.bytes_moved


def test_collection_plan_matches_its_tables_on_an_abstract_mesh():
  mesh = jax.sharding.AbstractMesh((2, 4), ("data", "model"))
  plan = plan_collection([TableSpec("t", 1000, 64)], [FeatureSpec("f", "t")], mesh=mesh,
                         replicate_below_bytes=0)
  assert plan["t"].plan.table_axes == ("model",) and plan["t"].plan.data_axes == ("data",)


def test_a_grid_table_prints_its_column_axes_and_is_never_stacked():
  tables = [TableSpec("items", 99, 10, sharding="grid", column_axes="data"),
            TableSpec("tags", 4000, 10, sharding="routed")]
  feats = [FeatureSpec("f", "items"), FeatureSpec("g", "tags")]
  plan = plan_collection(tables, feats, mesh={"data": 2, "model": 4}, batch_size=64,
                         table_batched=True)
  grid = plan["items"]
  assert grid.stack is None and plan["tags"].stack is not None
  assert (grid.plan.table_axes, grid.plan.column_axes) == (("model",), ("data",))
  assert grid.plan.padded_shape == (100, 10)
  text = str(plan)
  row = [line for line in text.splitlines() if line.startswith("items")][0]
  assert "grid" in row
  # The reason is wrapped below its row (plans fit 100 columns).
  assert "columns over ('data',)" in " ".join(text.split())


def test_tables_past_int32_rows_raise_at_plan_time_naming_the_table_and_the_fix():
  """Planned only (no table is built): a stack of 8 whole 293M-row tables is 2.3e9 rows."""
  rows = 293_000_000
  tables = [TableSpec(f"t{i}", rows, 128, sharding="table") for i in range(8)]
  feats = [FeatureSpec(f"f{i}", f"t{i}", max_ids_per_sample=1) for i in range(8)]
  with pytest.raises(ValueError, match=r"t0 \(293,000,000 rows\).*2,344,000,000 physical rows"
                     r".*int32 ids.*sharding='vocab' or 'routed'"):
    plan_collection(tables, feats, mesh={"batch": 8}, batch_size=512)
  # Split by rows over the same devices, each table fits.
  split = [TableSpec(f"t{i}", rows, 128, sharding="vocab") for i in range(8)]
  assert plan_collection(split, feats, mesh={"batch": 8}, batch_size=512)
  with pytest.raises(ValueError, match=r"big: 2,147,483,647 rows \(padded to 2,147,483,648 "
                     r"for vocab over 8\).*split the table"):
    plan_collection([TableSpec("big", 2**31 - 1, 64, sharding="vocab")],
                    [FeatureSpec("f", "big")], mesh={"batch": 8}, batch_size=512)


def test_auto_dedups_only_where_the_bytes_it_saves_pay_for_its_work():
  """Dedup saving bytes is not enough: the saving must exceed its work on the ids.

  Two routed tables read by 16 ids a sample (256 ids a shard) over 128 rows,
  so about half the ids repeat: 64 wide, a repeat saves a 256-byte row; 4
  wide, a 16-byte one, less than ``cost.DEDUP_BYTES_PER_ID``. A bytes-only
  rule would dedup both.
  """
  from embedlib.plan import cost
  tables = [TableSpec("wide", 128, 64, sharding="routed"),
            TableSpec("narrow", 128, 4, sharding="routed")]
  features = [FeatureSpec(f"f_{t.name}", t.name, max_ids_per_sample=16) for t in tables]
  plan = plan_collection(tables, features, mesh={"batch": 8}, batch_size=128,
                         num_unique={"wide": "auto", "narrow": "auto"})
  fixed = plan_collection(tables, features, mesh={"batch": 8}, batch_size=128,
                          num_unique={"wide": 128, "narrow": 128})
  ids = 128 // 8 * 16
  for t in fixed.tables:  # dedup at its full capacity moves fewer bytes for both
    assert 0 < t.bytes_moved_dedup < t.bytes_moved, t.name
  saved = {t.name: t.bytes_moved - t.bytes_moved_dedup for t in fixed.tables}
  assert saved["wide"] > cost.DEDUP_BYTES_PER_ID * ids > saved["narrow"], saved
  assert plan["wide"].num_unique is not None and plan["narrow"].num_unique is None
  assert plan["wide"].bytes_moved_dedup < plan["wide"].bytes_moved


def test_auto_chooses_a_layout_and_its_dedup_together():
  """Skewed ids make a routed lookup with dedup cheaper than the layout chosen without it.

  20,000 x 256, a pooled bag of 8, 1,024 ids a shard. Uniform ids repeat
  little: vocab rows (a pooled row per sample) win, and no dedup. At skew
  1 a shard holds about 550 distinct ids: routing those (and dedup's work,
  counted as ``cost.DEDUP_BYTES_PER_ID`` bytes an id) moves less than
  vocab. Choosing the layout first, as the planner did, kept vocab and
  never weighed dedup against it.
  """
  from embedlib.plan import cost
  features = [FeatureSpec("clicks", "items", max_ids_per_sample=8)]
  kw = dict(mesh={"batch": 8}, batch_size=1024, num_unique={"items": "auto"})
  uniform = plan_collection([TableSpec("items", 20_000, 256)], features, **kw)["items"]
  skewed = plan_collection([TableSpec("items", 20_000, 256, id_skew=1.0)], features, **kw)
  layout_first = plan_collection([TableSpec("items", 20_000, 256, id_skew=1.0)], features,
                                 mesh={"batch": 8}, batch_size=1024)["items"]
  assert (uniform.plan.strategy, uniform.num_unique) == ("vocab", None)
  assert layout_first.plan.strategy == "vocab"
  chosen = skewed["items"]
  assert chosen.plan.strategy == "routed"
  ids = 1024 // 8 * 8
  assert chosen.num_unique == cost.dedup_capacity([(ids, 20_000, 1.0)]) < 0.7 * ids
  step = lambda t, moved: moved + t.bytes_moved_update
  assert (step(chosen, chosen.bytes_moved_dedup) + cost.DEDUP_BYTES_PER_ID * ids
          < step(layout_first, layout_first.bytes_moved))
  assert "with dedup where it pays" in chosen.plan.reason
  # The same table's collection builds with that plan and looks up exactly.
  coll = EmbeddingCollection([TableSpec("items", 20_000, 256, id_skew=1.0)], features,
                             mesh=jax.make_mesh((8,), ("batch",)), batch_size=1024,
                             rngs=nnx.Rngs(0))
  assert coll.num_unique == {"items": chosen.num_unique}


def test_fit_id_skews_gives_each_table_the_skew_of_its_shards_ids():
  """Per table, over every feature reading it, the least-repeating shard's skew."""
  import numpy as np
  from embedlib.collection import fit_id_skews
  from embedlib.plan import cost
  rng = np.random.default_rng(0)
  tables = [TableSpec("item", 50_000, 8), TableSpec("user", 50_000, 8)]
  features = [FeatureSpec("clicks", "item", max_ids_per_sample=4),
              FeatureSpec("buys", "item", max_ids_per_sample=2),
              FeatureSpec("user", "user", max_ids_per_sample=1)]
  hot = (rng.zipf(1.3, (512, 4)) - 1) % 50_000
  hot[:, 3] = -1  # padding: slots, not ids
  inputs = {"clicks": hot, "buys": (rng.zipf(1.3, (512, 2)) - 1) % 50_000,
            "user": rng.integers(0, 50_000, 512)}
  skews = fit_id_skews(tables, features, inputs, data_shards=4)
  assert skews["user"] == 0.0 and skews["item"] > 0.5
  shard = np.concatenate([inputs["clicks"][:128].ravel(), inputs["buys"][:128].ravel()])
  per_shard = [cost.fit_id_skew(128 * 6, len(np.unique(s[s >= 0])), 50_000)
               for s in (np.concatenate([inputs["clicks"][i:i + 128].ravel(),
                                         inputs["buys"][i:i + 128].ravel()])
                         for i in range(0, 512, 128))]
  assert skews["item"] == min(per_shard)
  assert len(np.unique(shard[shard >= 0])) < 128 * 5
  with pytest.raises(ValueError, match="inputs name feature 'views'"):
    fit_id_skews(tables, features, {"views": hot})
  with pytest.raises(ValueError, match="data_shards must be an int >= 1"):
    fit_id_skews(tables, features, inputs, data_shards=0)
