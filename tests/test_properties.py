"""Property-based tests: random tables, meshes, layouts, id dtypes and ids.

Each example builds a ``ShardedEmbed`` or an ``EmbeddingCollection`` from
small pools (``tests/property_oracle.py``) and checks that every call either
returns the numpy reference or raises one of embedlib's documented errors
(``ValueError`` / ``IndexError`` / ``TypeError`` naming the table or
feature), as predicted from the inputs alone. A raw XLA or JAX error, a
valid call that raises, an invalid one that returns, or a wrong answer fails.

Tolerances: lookups (rows, sequence features) are exact: each output
element is one table element. Pooled bags and ``attend`` are f32 sums of at
most ``k`` products computed in another order than the float64 reference;
each sum's rounding error is at most ``k * eps32`` times the sum of the
terms' magnitudes, so the check allows ``(2k + 4) * eps32 * sum |term|``
per element (the factor 2 and the 4 cover the combiner's division and its
f32 denominator).

Budget: examples are few and derandomized (CI sees the same ones every
run), drawn from pools small enough that later examples reuse the programs
earlier ones compiled; ``EMBEDLIB_HYPOTHESIS_EXAMPLES=N`` runs ``N`` random
ones per test for a deep local run. x64 stays off in-process: 64-bit ids
are tested as numpy arrays (the host path), JAX arrays only in the dtypes
x64-off JAX holds.
"""

from __future__ import annotations

import os

import jax
import numpy as np
from flax import nnx
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from jax.experimental import checkify

import embedlib
from tests import property_oracle as oracle

EPS32 = float(np.finfo(np.float32).eps)
DEEP = int(os.environ.get("EMBEDLIB_HYPOTHESIS_EXAMPLES", "0"))
TABLE = "prop_table"

#: Id shapes: batch first; scalars, empty batches and empty bags included.
ID_SHAPES = ((6, 3), (3,), (1,), (8, 1), (3, 2, 2), (), (0,), (0, 3), (3, 0))
QUERY_BATCH = ((3,), (), (2, 2), (0,))


def budget(examples: int):
  # CI runs the same few examples every time; a deep run draws new ones
  # (a failure prints the blob that reproduces it).
  return settings(
      max_examples=DEEP or examples, deadline=None, derandomize=not DEEP, database=None,
      suppress_health_check=list(HealthCheck), print_blob=True,
  )


def assert_sum_close(got, want, magnitude, terms: int, what: str):
  """``|got - want| <= (2 terms + 4) eps32 * magnitude`` elementwise (module docstring)."""
  got = np.asarray(got, np.float64)
  assert got.shape == want.shape, (what, got.shape, want.shape)
  tol = (2 * terms + 4) * EPS32 * magnitude + 1e-30
  bad = np.abs(got - want) > tol
  assert not bad.any(), (
      f"{what}: {bad.sum()} elements off; first at {np.argwhere(bad)[0]}: "
      f"got {got[bad][0]!r}, want {want[bad][0]!r}, tol {tol[bad][0]!r}")


def assert_pooled(got, table, dense, weights, combiner, what):
  want = oracle.pooled(table, dense, weights, combiner)
  absw = np.ones(dense.shape) if weights is None else np.abs(np.asarray(weights, np.float64))
  magnitude = np.abs(oracle.pooled(np.abs(table), dense, absw, combiner))
  assert_sum_close(got, want, magnitude, dense.shape[1], what)


_JITTED = []  # (graphdef, checked, fn): graphdefs holding dicts don't hash


def jitted(graphdef, checked: bool):
  """``module(*args)`` jitted (and checkified) once per module structure: compiles are reused."""
  for g, c, fn in _JITTED:
    if c == checked and g == graphdef:
      return fn
  fn = jax.jit(lambda state, *args: nnx.merge(graphdef, state)(*args))
  fn = checkify.checkify(fn) if checked else fn
  _JITTED.append((graphdef, checked, fn))
  return fn


def run_jitted(outcome, what, module, checked, *args):
  """``(output or None, checkify message or None)`` of the jitted call."""
  graphdef, state = nnx.split(module)
  result = oracle.call(outcome, what, lambda: jitted(graphdef, checked)(state, *args))
  if result is None or not checked:
    return result, None
  err, out = result
  # device_get first: on Explicit mesh axes err.get() alone fails inside JAX.
  return out, jax.device_get(err).get()


# -- ShardedEmbed ---------------------------------------------------------------


@budget(24)
@given(data=st.data())
def test_sharded_embed_matches_reference_or_raises_ours(data):
  draw = data.draw
  mesh_name, axis_type = draw(oracle.meshes, "mesh")
  mesh = oracle.mesh(mesh_name, axis_type)
  n = draw(st.sampled_from(oracle.NUM_EMBEDDINGS), "num_embeddings")
  f = draw(st.sampled_from(oracle.FEATURES), "features")
  strategy = draw(st.sampled_from(oracle.STRATEGIES), "sharding")
  kernel = draw(st.sampled_from(("auto", "xla", "pallas")), "kernel")
  mode = draw(st.sampled_from(("zero", "error")), "invalid_ids")
  replicate = draw(st.sampled_from((0, None)), "replicate_below_bytes")
  emb = oracle.call(oracle.Outcome(), "ShardedEmbed(...)", lambda: embedlib.ShardedEmbed(
      n, f, mesh=mesh, sharding=strategy, kernel=kernel, invalid_ids=mode, name=TABLE,
      replicate_below_bytes=replicate, rngs=nnx.Rngs(n + f), **oracle.mesh_kwargs(mesh_name)))
  event(f"plan: {emb.plan.strategy}, {len(emb.plan.token_axes)} token axes")
  table = oracle.host(emb.logical_table()).astype(np.float32)
  assert table.shape == (n, f)

  # Flat lookup, eager or jitted (JAX ids only: x64-off jit would narrow 64-bit host ids).
  shape = draw(st.sampled_from(ID_SHAPES), "ids shape")
  container = draw(st.sampled_from(oracle.CONTAINERS), "container")
  host_ids, exact = draw(oracle.ids_array(n, shape, container), "ids")
  ids = oracle.as_container(host_ids, container, mesh, emb.plan.data_axes)
  if shape == () and container == "numpy" and draw(st.booleans(), "python int"):
    ids = int(exact)
  invalid = not oracle.is_valid(exact, n).all()
  jit = container != "numpy" and draw(st.booleans(), "jit")
  event(f"lookup: {container}{' jit' if jit else ''}, {'invalid' if invalid else 'valid'}")
  outcome = oracle.Outcome()
  if mode == "error" and invalid and not jit:
    outcome.expect(IndexError, TABLE)
  if jit:
    out, message = run_jitted(outcome, "jit(emb)(ids)", emb, mode == "error", ids)
    if mode == "error" and invalid:
      assert message and TABLE in message and f"[0, {n})" in message, message
    else:
      assert message is None, message
  else:
    out = oracle.call(outcome, "emb(ids)", lambda: emb(ids))
  if out is not None:
    want = oracle.lookup(table, exact)
    assert out.shape == want.shape and out.dtype == np.float32, (out.shape, out.dtype)
    np.testing.assert_array_equal(oracle.host(out), want)

  # Pooled bags of the same ids: [batch, bag] only; weights like the ids.
  combiner = draw(st.sampled_from(oracle.COMBINERS), "combiner")
  weights = None
  if draw(st.booleans(), "weighted"):
    rng = np.random.default_rng(draw(st.integers(0, 2**16), "weights seed"))
    weights = oracle.weights(rng, shape)
  outcome = oracle.Outcome()
  if len(shape) != 2:
    outcome.expect(ValueError, TABLE)
  if mode == "error" and not (oracle.is_valid(exact, n) | (exact == -1)).all():
    outcome.expect(IndexError, TABLE)  # -1 is a bag's padding, even in error mode
  w = None if weights is None else oracle.as_container(weights, container, mesh,
                                                        emb.plan.data_axes)
  event(f"bag: {'error' if outcome.errors else 'value'}")
  out = oracle.call(outcome, "emb.bag(ids)", lambda: emb.bag(ids, w, combiner=combiner))
  if out is not None:
    assert_pooled(oracle.host(out), table, exact, weights, combiner, f"bag({combiner})")

  # attend: exactly num_embeddings logits.
  qshape = draw(st.sampled_from(QUERY_BATCH), "query batch") + (f,)
  rng = np.random.default_rng(draw(st.integers(0, 2**16), "query seed"))
  query = rng.uniform(-1, 1, qshape).astype(np.float32)
  out = oracle.call(oracle.Outcome(), "emb.attend(q)", lambda: emb.attend(query))
  want = query.astype(np.float64) @ table.astype(np.float64).T
  assert_sum_close(oracle.host(out), want, np.abs(query) @ np.abs(table).T, f, "attend")


# -- EmbeddingCollection --------------------------------------------------------

#: Feature forms: padded bags, [batch] single-hot, ragged (values, lengths),
#: sequence [batch, bag] rows, single-hot sequence [batch] rows.
KINDS = ("bag", "single", "ragged", "sequence", "sequence_single")
BATCHES = (6, 3, 1, 8, 0)


@st.composite
def feature_case(draw, name, table, batch, jit):
  """One feature: its spec, host inputs, the dense reference ids and its faults.

  Returns a dict: ``spec``; ``ids`` (host array, or ``(values, lengths)``)
  and ``weights`` (host or None) as the caller will give them;
  ``container``; ``ragged_type``; ``dense``: exact ``[batch]`` or
  ``[batch, bag]`` Python-int ids padded with ``-1``, as the reference pools
  them (ragged bags truncated to ``max_ids_per_sample``, as under jit);
  ``dense_weights``; ``errors``: eager ``(type, name)`` faults; ``traced_errors``:
  those also raised under jit.
  """
  kind = draw(st.sampled_from(KINDS), f"{name} kind")
  n = table.num_embeddings
  sequence = kind.startswith("sequence")
  combiner = None if sequence else draw(st.sampled_from(oracle.COMBINERS), f"{name} combiner")
  # Under jit, JAX arrays only: x64-off jit would narrow 64-bit host ids.
  containers = oracle.CONTAINERS[1:] if jit else oracle.CONTAINERS
  container = draw(st.sampled_from(containers), f"{name} container")
  weighted = draw(st.booleans(), f"{name} weighted")
  rng = np.random.default_rng(draw(st.integers(0, 2**16), f"{name} seed"))
  errors, traced = [], []
  if sequence and weighted:  # rows are unpooled: weights are a mistake
    errors.append((ValueError, name))
    traced.append((ValueError, name))
  lengths = None
  if kind in ("single", "sequence_single"):
    limit = 1
    ids, exact = draw(oracle.ids_array(n, (batch,), container), f"{name} ids")
    dense, wshape = exact, (batch,)
  elif kind == "ragged":
    limit = draw(st.sampled_from((3, 1)), f"{name} max_ids_per_sample")
    lengths = draw(st.lists(st.integers(0, limit), min_size=batch, max_size=batch),
                   f"{name} lengths")
    if batch and draw(st.integers(0, 9), f"{name} overlong") == 0:
      lengths[0] = limit + 1  # eager: an error; under jit: truncated (documented)
      errors.append((ValueError, name))
    spare = draw(st.integers(0, 2), f"{name} spare capacity")
    values, exact = draw(oracle.ids_array(n, (sum(lengths) + spare,), container),
                         f"{name} values")
    lengths = np.array(lengths, np.int32)
    ids = (values, lengths)
    dense, wshape = oracle.ragged_to_dense(exact, lengths, limit), (len(exact),)
  else:
    width = draw(st.sampled_from((3, 1)), f"{name} bag width")
    limit = draw(st.sampled_from((None, width, max(width - 1, 1))), f"{name} max_ids_per_sample")
    if limit is not None and width > limit:
      errors.append((ValueError, name))
      traced.append((ValueError, name))
    ids, exact = draw(oracle.ids_array(n, (batch, width), container), f"{name} ids")
    dense, wshape = exact, (batch, width)
  weights = oracle.weights(rng, wshape) if weighted else None
  dense_weights = weights
  if kind == "ragged" and weighted:
    dense_weights = oracle.ragged_to_dense(list(weights), lengths, limit)
    dense_weights = np.where(dense_weights == -1, 0.0, dense_weights).astype(np.float64)
  return dict(
      spec=embedlib.FeatureSpec(name, table.name, combiner=combiner, max_ids_per_sample=limit),
      ids=ids, weights=weights, container=container,
      ragged_type=kind == "ragged" and draw(st.booleans(), f"{name} as Ragged"),
      dense=dense, dense_weights=dense_weights, errors=errors, traced_errors=traced,
  )


def distinct_per_shard(dense_ids, n: int, shards: int) -> int:
  """The most distinct valid ids any data shard holds (the dedup capacity needed).

  The batch is padded to a multiple of the data shards and split in blocks.
  """
  bags = np.concatenate([d if d.ndim == 2 else d[:, None] for d in dense_ids], axis=1)
  per = -(-len(bags) // shards)
  return max(
      (len({int(v) for v in bags[s * per:(s + 1) * per].ravel() if 0 <= v < n})
       for s in range(shards)), default=0)


def _given(case, mesh, data_axes):
  """A feature's ids and weights in its container."""
  put = lambda x: oracle.as_container(x, case["container"], mesh, data_axes)
  ids = case["ids"]
  if isinstance(ids, tuple):
    ids = (put(ids[0]), put(ids[1]))
    ids = embedlib.collection.Ragged(*ids) if case["ragged_type"] else ids
  else:
    ids = put(ids)
  return ids, None if case["weights"] is None else put(case["weights"])


@budget(16)
@given(data=st.data())
def test_collection_matches_reference_or_raises_ours(data):
  draw = data.draw
  mesh_name, axis_type = draw(oracle.meshes, "mesh")
  mesh = oracle.mesh(mesh_name, axis_type)
  tables = [
      embedlib.TableSpec(
          f"tab{i}", draw(st.sampled_from(oracle.NUM_EMBEDDINGS), f"tab{i} num_embeddings"),
          draw(st.sampled_from(oracle.FEATURES), f"tab{i} features"),
          sharding=draw(st.sampled_from(oracle.STRATEGIES), f"tab{i} sharding"))
      for i in range(draw(st.integers(1, 2), "tables"))
  ]
  batch = draw(st.sampled_from(BATCHES), "batch")
  jit = draw(st.booleans(), "jit")
  cases = []
  for j in range(draw(st.integers(len(tables), 3), "features")):  # every table read
    table = tables[j] if j < len(tables) else draw(st.sampled_from(tables), f"feat{j} table")
    cases.append(draw(feature_case(f"feat{j}", table, batch, jit)))
  num_unique = draw(st.sampled_from((None, 4, 1, 64)), "num_unique")
  on_overflow = draw(st.sampled_from(("fallback", "error")), "on_overflow")
  coll = oracle.call(oracle.Outcome(), "EmbeddingCollection(...)",
                     lambda: embedlib.EmbeddingCollection(
      tables, [c["spec"] for c in cases], mesh=mesh, num_unique=num_unique,
      on_overflow=on_overflow, replicate_below_bytes=0, rngs=nnx.Rngs(0),
      **oracle.mesh_kwargs(mesh_name)))
  data_axes = coll.plan.tables[0].plan.data_axes
  inputs, weights = {}, {}
  for c in cases:
    inputs[c["spec"].name], w = _given(c, mesh, data_axes)
    if w is not None:
      weights[c["spec"].name] = w
  event(f"collection: {'jit' if jit else 'eager'}, dedup {num_unique} {on_overflow}")
  event(f"collection mesh: {mesh_name}")

  outcome = oracle.Outcome()
  for c in cases:
    outcome.errors += c["traced_errors" if jit else "errors"]
  inputs_ok = not outcome.errors
  needs = {}
  for t in tables:
    dense = [c["dense"] for c in cases if c["spec"].table == t.name]
    needs[t.name] = distinct_per_shard(dense, t.num_embeddings, coll.plan[t.name].plan.data_shards)
  over = [t for t in needs if num_unique is not None and needs[t] > num_unique]
  checked = jit and on_overflow == "error" and num_unique is not None
  if on_overflow == "error" and not jit:
    for t in over:
      outcome.expect(ValueError, t)
  event(f"collection call: {'error' if outcome.errors else 'value'}")
  if jit:
    out, message = run_jitted(outcome, "jit(coll)(inputs, weights)", coll, checked, inputs, weights)
    if checked and over and out is not None:
      # Overflowed with on_overflow="error": the check fails, the rows are void.
      assert message and any(f"table {t!r}" in message for t in over), message
      return
    assert message is None, message
  else:
    out = oracle.call(outcome, "coll(inputs, weights)", lambda: coll(inputs, weights))
  if inputs_ok and num_unique is not None and not jit:
    counts = oracle.call(oracle.Outcome(), "coll.unique_counts", lambda: coll.unique_counts(inputs))
    assert counts == needs, (counts, needs)
  if out is None:
    return
  assert list(out) == [c["spec"].name for c in cases]
  for c in cases:
    spec, dense = c["spec"], c["dense"]
    table = oracle.host(coll.tables[spec.table].logical_table()).astype(np.float32)
    got = oracle.host(out[spec.name])
    if spec.is_sequence:
      np.testing.assert_array_equal(got, oracle.lookup(table, dense), err_msg=spec.name)
    else:
      dense = dense if dense.ndim == 2 else dense[:, None]
      w = c["dense_weights"]
      w = None if w is None else np.asarray(w, np.float64).reshape(dense.shape)
      assert_pooled(got, table, dense, w, spec.combiner, f"{spec.name} ({spec.combiner})")
