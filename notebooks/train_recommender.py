# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Train a recommender, then restore it on a different number of devices
#
# `embedlib.training.train_and_evaluate` is everything behind
# `python -m train --config configs/quickstart.py`: a small DLRM (8 embedding
# tables, one of them multi-hot) on planted synthetic data whose best possible
# AUC (the hidden model's, `oracle_auc`) is known. The full quickstart's time
# and AUC are in the docstring of `configs/quickstart.py`; set
# `EMBEDLIB_NOTEBOOK_SMOKE=1` for a few steps (CI does).
#
# Checkpoints hold logical, unpadded tables, so a run saved on 8 devices loads
# onto 4 (with other padding) and looks up the same rows.

# %%
# Colab only: install embedlib (a local checkout has it installed already).
# EMBEDLIB_PIP: what pip installs, default the embedlib package; set it to your
# checkout (a git URL or a path) to run an unreleased version.
import os
import subprocess
import sys

if "google.colab" in sys.modules:
  subprocess.run([sys.executable, "-m", "pip", "install", "-q",
                  os.environ.get("EMBEDLIB_PIP", "embedlib")], check=True)

# Without a GPU, 8 simulated CPU devices (before jax is imported); the checkout's
# configs/ on the path (embedlib/notebook.py says what it does).
from embedlib import notebook  # noqa: E402

notebook.start()

# %%
import jax
import matplotlib.pyplot as plt
import numpy as np
from flax import nnx
from jax.sharding import AxisType

from configs import quickstart  # noqa: E402
from embedlib import checkpoint
from embedlib import data as data_lib
from embedlib.training import setup, train_lib
from embedlib.training.writers import read_jsonl

print(notebook.runtime())

# %% [markdown]
# ## Train
#
# The config is a plain `ConfigDict`: change any value before the call. A fresh
# workdir each time (an existing one would resume from its last checkpoint).

# %%
config = quickstart.get_config(notebook.config_arg())
workdir = notebook.fresh_workdir("quickstart")
print(f"quickstart: {config.num_train_steps} steps of {config.batch_size} examples, "
      f"workdir {workdir}")

result = train_lib.train_and_evaluate(config, workdir)
print(result)
print(f"AUC {result['auc']:.4f}, {train_lib.oracle_gap(result):.4f} below the oracle's")

# %% [markdown]
# ## Loss and AUC curves, from the run's metrics
#
# `train.jsonl` has the mean training loss per logging window, `eval.jsonl` the
# eval AUC and log-loss (and the oracle AUC the model is chasing).

# %%
train_log = read_jsonl(os.path.join(workdir, "train.jsonl"))
eval_log = read_jsonl(os.path.join(workdir, "eval.jsonl"))

fig, (ax_loss, ax_auc) = plt.subplots(1, 2, figsize=(12, 4))
ax_loss.plot([r["step"] for r in train_log], [r["loss"] for r in train_log], label="train loss")
ax_loss.plot([r["step"] for r in eval_log], [r["logloss"] for r in eval_log], "o-",
             label="eval log-loss")
ax_loss.set_xlabel("step")
ax_loss.legend()
ax_auc.plot([r["step"] for r in eval_log], [r["auc"] for r in eval_log], "o-", label="eval AUC")
ax_auc.axhline(eval_log[-1]["oracle_auc"], color="gray", linestyle="--", label="oracle AUC")
ax_auc.set_xlabel("step")
ax_auc.legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Restore the checkpoint onto fewer devices
#
# Build the same model on the training mesh and on one with half the devices,
# restore the last checkpoint into each, and look up the same batch. Tables
# whose sizes divide differently are padded differently, yet the logical tables
# are identical, single-hot lookups bit-identical, and pooled bags equal up to
# the order their partial sums are added in. (A one-device runtime restores onto
# one device again.)

# %%
task = setup.task(config)
spec = task.data_spec()
ckpt = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"))
print("latest checkpoint: step", ckpt.latest_step())

n = jax.device_count()
models = []  # (devices, model, mesh): the training mesh, then the smaller one
for num_devices in (n, max(1, n // 2)):
  mesh = jax.make_mesh((num_devices,), tuple(config.mesh_axes), axis_types=(AxisType.Auto,),
                       devices=jax.devices()[:num_devices])
  model, optimizer = setup.model_and_optimizer(config, task, spec, mesh)
  data_state = ckpt.restore(model, optimizer)
  models.append((num_devices, model, mesh))
  shapes = {k: t.embedding.shape for k, t in model.embeddings.tables.items()}
  print(f"{num_devices} devices: physical tables {shapes}")
ckpt.close()
print("data position saved with the checkpoint:", data_state)

# %%
source, _ = setup.sources(config, task, spec)
batch = next(source)
(n_big, big, big_mesh), (n_small, small, small_mesh) = models
# Compiled once per mesh: run eagerly, the collection would dispatch op by op.
embed = nnx.jit(lambda model, sparse: model.embeddings(sparse))
lookups_big = embed(big, data_lib.to_global_batch(batch, big_mesh)["sparse"])
lookups_small = embed(small, data_lib.to_global_batch(batch, small_mesh)["sparse"])
for k, table in big.embeddings.tables.items():
  np.testing.assert_array_equal(np.asarray(small.embeddings.tables[k].logical_table()),
                                np.asarray(table.logical_table()))
  if batch["sparse"][k].ndim == 1:  # single-hot: bit-identical
    np.testing.assert_array_equal(np.asarray(lookups_small[k]), np.asarray(lookups_big[k]))
  else:  # pooled bag: partial sums added in a mesh-dependent order
    np.testing.assert_allclose(np.asarray(lookups_small[k]), np.asarray(lookups_big[k]),
                               rtol=1e-6, atol=1e-7)
logits_big = train_lib.eval_step(big, data_lib.to_global_batch(batch, big_mesh), task=task)
logits_small = train_lib.eval_step(small, data_lib.to_global_batch(batch, small_mesh),
                                    task=task)
np.testing.assert_allclose(np.asarray(logits_small), np.asarray(logits_big), rtol=1e-5, atol=1e-5)
print(f"{len(lookups_big)} features: the {n_big}-device and {n_small}-device models "
      f"look up the same rows and predict the same logits (max diff "
      f"{np.abs(np.asarray(logits_small) - np.asarray(logits_big)).max():.1e})")
