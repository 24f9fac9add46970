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
# # embedlib quickstart: one table, split over a 2-D mesh
#
# `embedlib.ShardedEmbed` is a drop-in `nnx.Embed` whose table is laid out over a
# device mesh: by vocabulary rows, by hidden columns, or not at all. It pads sizes
# that don't divide, and every layout gives exactly the single-device answer.
#
# Runs on a free Colab CPU runtime (8 simulated devices) and on a GPU or TPU
# runtime (its real devices).

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
import jax.numpy as jnp
import numpy as np
from flax import nnx

import embedlib
from embedlib import axes
from embedlib import options

print(notebook.runtime())

# %% [markdown]
# ## A 2-D mesh and a GPT-2-sized tied table
#
# The mesh has a `data` axis (the batch is split over it) and a `model` axis
# (the table is split over it). GPT-2's vocabulary, 50257, does not divide 4
# ranks; the table is padded to 50260 rows, and the padding never reaches an
# output. The plan says what was chosen, why, and what it costs.

# %%
n = jax.device_count()
mesh = jax.make_mesh((2, n // 2) if n % 2 == 0 else (1, n), (axes.DATA, axes.MODEL))
emb = embedlib.ShardedEmbed(50257, 768, mesh=mesh, layout=embedlib.Layout(tied=True),
                            name="gpt2_vocab", rngs=nnx.Rngs(0))
print(emb.plan)

# %% [markdown]
# ## Where the table lives
#
# `emb.embedding` reads as the logical table, as `nnx.Embed`'s does; it is
# stored padded (`emb.physical_table()`, of shape `emb.plan.padded_shape`).
# Each block below is one shard of the stored table and the devices holding
# it. A vocab layout splits rows over `model` and keeps a copy per `data` rank.

# %%
print("physical", emb.plan.padded_shape, "logical", emb.embedding.shape)
jax.debug.visualize_array_sharding(emb.physical_table())

# %% [markdown]
# ## Lookups and the tied output layer match the plain reference
#
# The reference is the unsharded computation: `jnp.take` on the logical table,
# and `query @ table.T` for `attend` (exactly 50257 logits, no padding).
# Invalid ids (here `-1`) look up zeros.

# %%
table = np.asarray(emb.logical_table())
ids = jnp.array([[0, 5, 50256, 17], [7, 11, 3, 42]])
rows = emb(ids)
np.testing.assert_array_equal(np.asarray(rows), np.asarray(jnp.take(table, ids, axis=0)))
print("lookup", rows.shape, "equals jnp.take")

query = jax.random.normal(jax.random.key(1), (2, 768))
logits = emb.attend(query)
np.testing.assert_allclose(np.asarray(logits), np.asarray(query) @ table.T, rtol=1e-5, atol=1e-4)
print("attend", logits.shape, "equals query @ table.T")

assert not np.asarray(emb(jnp.array([-1]))).any()
print("id -1 looks up zeros")

# %% [markdown]
# ## Choosing the layout yourself
#
# `sharding="hidden"` splits columns instead; `embedlib.plan_embedding` shows
# any plan without allocating a table.

# %%
for strategy in options.STRATEGIES:
  p = embedlib.plan_embedding(50257, 768, mesh=mesh, sharding=strategy, tied=True)
  print(f"{strategy:>10}: padded {p.padded_shape}, {p.bytes_per_device / 2**20:.1f} MiB/device, "
        f"{p.bytes_moved_per_lookup / 2**20:.1f} MiB moved per lookup")
