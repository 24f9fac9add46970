"""Retrieval and next-item artifacts: the top k of the in-process model's own scores.

Tiny models built from the ``:smoke`` configs (untrained: the export doesn't
care), exported for one CPU device and compared with the model run here.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import movielens, two_tower
from embedlib import serving
from embedlib.training import export_lib, setup
from tests.train.test_sequential import write_ml100k

K = 5


def _exported(config, out, **kw):
  mesh = export_lib.serving_mesh(config, 1)
  task = setup.task(config)
  spec = task.data_spec()
  model, _ = setup.model_and_optimizer(config, task, spec, mesh)
  export_lib.export(config, model, mesh, str(out), batch_size=8, top_k=K, **kw)
  _, source = setup.sources(config, task, spec)
  return model, mesh, task, source, serving.load(out)


def _check_top_k(got, scores):
  """``got`` is the top K of ``scores`` (``-inf``: never returned), scores bit for bit."""
  scores = np.asarray(scores)
  want = np.argsort(-scores, axis=1, kind="stable")[:, :K]
  np.testing.assert_array_equal(got["items"], want)
  np.testing.assert_array_equal(got["scores"], np.take_along_axis(scores, want, axis=1))


@pytest.mark.parametrize("variant", ["smoke", "smoke,hstu"])
def test_next_item_top_k_over_the_vocabulary_without_the_history(variant, tmp_path):
  config = movielens.get_config(variant)
  config.data.path = str(write_ml100k(tmp_path / "ml"))
  model, _, task, source, served = _exported(config, tmp_path / "art", exclude_input=True)
  batch = task.featurize(next(source))
  got = served({n: batch[n] for n in served.input_names})
  assert served.manifest["exclude_input"] and served.manifest["top_k"] == K
  scores = nnx.jit(lambda m, b: m.logits(m(b)[:, -1], b["items"]))(
      model, {k: batch[k] for k in ("items", "times", "query_times")})
  scores = np.array(scores)
  scores[:, 0] = -np.inf
  for row, items in zip(scores, batch["items"]):
    row[items[items > 0]] = -np.inf
  _check_top_k(got, scores)
  assert not any(set(top) & set(items) for top, items in zip(got["items"], batch["items"]))


def test_retrieval_top_k_over_the_precomputed_item_tower(tmp_path):
  config = two_tower.get_config("smoke")
  model, mesh, task, source, served = _exported(config, tmp_path / "art")
  names = [w["name"] for w in served.manifest["weights"]]
  assert names[-1] == "corpus"  # the item tower's embeddings travel as a weight
  batch = task.featurize(next(source))
  got = served({n: batch[n] for n in served.input_names})
  corpus = task.corpus(model, mesh, source.catalogue())
  # One program, as the artifact's, on batches of its size: XLA:CPU's product
  # of 32 rows rounds other than four products of 8.
  fn = nnx.jit(lambda m, b, c: jnp.where(jnp.arange(c.shape[0]) < task.spec.num_items,
                                         m.users(b) @ c.T, -jnp.inf))
  scores = np.concatenate([  # in the artifact's batches of 8
      fn(model, {n: batch[n][i:i + 8] for n in served.input_names}, corpus)
      for i in range(0, len(batch["user"]), 8)])
  _check_top_k(got, scores)
  assert got["items"].max() < task.spec.num_items


def test_top_k_past_the_items_is_refused(tmp_path):
  config = two_tower.get_config("smoke")
  mesh = export_lib.serving_mesh(config, 1)
  task = setup.task(config)
  model, _ = setup.model_and_optimizer(config, task, task.data_spec(), mesh)
  with pytest.raises(export_lib.ExportError, match=r"--top_k=5000: must lie in \[1, 2000\]"):
    export_lib.export(config, model, mesh, str(tmp_path / "a"), top_k=5000)


def test_predict_writes_each_users_next_items_in_the_files_ids(tmp_path):
  import io  # pylint: disable=import-outside-toplevel

  from embedlib.data import movielens as movielens_data  # pylint: disable=import-outside-toplevel
  from train import predict as predict_lib  # pylint: disable=import-outside-toplevel

  config = movielens.get_config("smoke")
  config.data.path = str(write_ml100k(tmp_path / "ml"))
  _, _, _, _, served = _exported(config, tmp_path / "art", exclude_input=True)
  out = io.StringIO()
  assert predict_lib.predict_next_items(served, config.data.path, out, batch_size=16) == 40
  lines = out.getvalue().splitlines()
  data = movielens_data.load(config.data.path)
  assert [int(line.split("\t")[0]) for line in lines] == data.raw_user_ids.tolist()
  max_len = config.data.max_len
  for u, line in enumerate(lines):
    top = [int(x) for x in line.split("\t")[1].split()]
    history = data.raw_item_ids[data.item[data.user == u]][-max_len:]
    assert len(top) == K and not set(top) & set(history.tolist())
  # The last user's line is the artifact's answer for that user's last max_len items.
  items = data.item[data.user == 39][-max_len:]
  row = np.zeros((1, max_len), np.int64)
  row[0, max_len - len(items):] = items  # the same file: the same dense ids
  best = served({"items": row})["items"][0]
  assert lines[-1].split("\t")[1] == " ".join(str(data.raw_item_ids[i]) for i in best)


@pytest.mark.slow  # the CTR artifact's sharded test covers the layouts; this, the corpus
def test_a_sharded_retrieval_artifact_keeps_its_corpus_split(tmp_path):
  config = two_tower.get_config("smoke")
  mesh = export_lib.serving_mesh(config, 4)
  task = setup.task(config)
  model, _ = setup.model_and_optimizer(config, task, task.data_spec(), mesh)
  export_lib.export(config, model, mesh, str(tmp_path / "art"), batch_size=8, top_k=K)
  served = serving.load(tmp_path / "art")
  corpus = served.weights[-1]
  assert corpus.sharding.spec[0] is not None and served.mesh.size == 4  # rows split over 4
  _, source = setup.sources(config, task, task.data_spec())
  batch = task.featurize(next(source))
  got = served({n: batch[n] for n in served.input_names})
  score = export_lib.scoring(config, model, mesh, top_k=K)
  jitted, _, weights, _ = export_lib.serving_function(model, mesh, score, 8)
  for i in range(0, len(batch["user"]), 8):
    columns, _ = served._columns({n: batch[n][i:i + 8] for n in served.input_names})  # pylint: disable=protected-access
    items, scores = jitted(*weights, *columns)
    np.testing.assert_array_equal(got["items"][i:i + 8], items)
    np.testing.assert_array_equal(got["scores"][i:i + 8], scores)


@pytest.mark.parametrize("variant, bits", [("smoke", 8), ("smoke,hstu", 4)])
def test_a_quantized_next_item_artifact_scores_as_the_quantized_model(variant, bits, tmp_path):
  """The tied item table quantized too: its top k are the in-process quantized model's."""
  import embedlib  # pylint: disable=import-outside-toplevel

  config = movielens.get_config(variant)
  config.data.path = str(write_ml100k(tmp_path / "ml"))
  model, _, task, source, served = _exported(config, tmp_path / "art", bits=bits)
  assert isinstance(model.items, embedlib.QuantizedEmbed)  # export quantizes in place
  assert served.manifest["bits"] == bits
  batch = task.featurize(next(source))
  got = served({n: batch[n] for n in served.input_names})
  logits = nnx.jit(lambda m, b: m.logits(m(b)[:, -1], b["items"]))
  scores = np.concatenate([  # in the artifact's batches of 8
      logits(model, {k: batch[k][i:i + 8] for k in served.input_names})
      for i in range(0, len(batch["items"]), 8)])
  scores[:, 0] = -np.inf
  _check_top_k(got, scores)


@pytest.mark.slow  # two CLI runs; tests/train/test_checkpoint_dense_slots.py restores in-process
def test_a_one_device_next_item_run_exports_onto_four_devices(tmp_path):
  """``train.export --devices 4`` of a SASRec run trained on one device.

  Its tied item table, padded from 61 rows to 64 on four devices, restores
  with its Adam slots (stored logical); the artifact scores as the restored
  model does, and as the one-device model to 1e-5 (the sharded product
  sums in another order).
  """
  from tests.serving.conftest import run_module  # pylint: disable=import-outside-toplevel

  data = write_ml100k(tmp_path / "ml")
  workdir, out = tmp_path / "run", tmp_path / "art"
  done = run_module("train", "--config=configs/movielens.py:smoke",
                    f"--config.data.path={data}", f"--workdir={workdir}", "--cpu_devices=1")
  assert done.returncode == 0, done.stderr[-3000:]
  done = run_module("train.export", f"--workdir={workdir}", f"--out={out}", "--devices=4",
                    f"--top_k={K}")
  assert done.returncode == 0, done.stderr[-3000:]
  served = serving.load(out)
  assert served.mesh.size == 4
  config, model, mesh = export_lib.restore(str(workdir), devices=4)
  assert model.embed.items.plan.padded_shape[0] == 64
  task = setup.task(config)
  _, source = setup.sources(config, task, task.data_spec())
  batch = task.featurize(next(source))
  rows = config.batch_size  # the artifact's batch
  inputs = {n: batch[n][:rows] for n in served.input_names}
  got = served(inputs)
  score = export_lib.scoring(config, model, mesh, top_k=K)
  jitted, _, weights, _ = export_lib.serving_function(model, mesh, score, rows)
  columns, _ = served._columns(inputs)  # pylint: disable=protected-access
  items, scores = jitted(*weights, *columns)
  np.testing.assert_array_equal(got["items"], items)
  np.testing.assert_array_equal(got["scores"], scores)
  _, one, _ = export_lib.restore(str(workdir), devices=1)
  logits = nnx.jit(lambda m, b: m.logits(m(b)[:, -1], b["items"]))(
      one, {k: batch[k][:rows] for k in ("items", "times", "query_times")})
  np.testing.assert_allclose(got["scores"], np.take_along_axis(np.asarray(logits), got["items"],
                                                               axis=1), rtol=1e-5, atol=1e-6)
