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
# # Layouts side by side: the tables other systems reject
#
# Four scenarios that sharded-embedding systems refuse ("does not shard evenly"),
# each laid out by `embedlib`: the chosen strategy and why, the padding, the
# bytes each device stores and the bytes a lookup moves (all from the pure-Python
# planner, `embedlib.plan_embedding`), then a real lookup checked against the
# single-device reference, and a chart of what the other strategies would cost.

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
import matplotlib.pyplot as plt
import numpy as np
from flax import nnx

import embedlib
from embedlib import axes
from embedlib import options

print(notebook.runtime())

# %% [markdown]
# ## The scenarios
#
# Each is a table, a mesh (axis sizes) and the `ShardedEmbed` arguments; `tokens`
# is how many ids one lookup carries over the whole mesh.
#
# - **width 100 over 8 ranks**: 100 columns don't split over 8; hidden pads to 104.
# - **13 ids over 8 ranks**: a batch that doesn't divide the data shards.
# - **replica axis**: a `(2, 4)` mesh whose `replica` axis holds copies of the
#   table while ids are split over both axes.
# - **GPT-2 vocabulary over 8**: 50257 rows, tied to the output layer, so vocab.
# - **tensor 2 x fsdp 4**: the table over `tensor`, ids over `fsdp`; grid also
#   splits the columns over `fsdp` (rows over `tensor`, columns over `fsdp`: the
#   layout LLM code trains with), storing an eighth of the table a device.

# %%
scenarios = {
    "width 100 over 8": dict(
        num_embeddings=100_000, features=100, mesh={axes.BATCH: 8}, tokens=4096, kwargs={}),
    "13 ids over 8": dict(
        num_embeddings=100_000, features=64, mesh={axes.BATCH: 8}, tokens=13, kwargs={}),
    "replica axis (2, 4)": dict(
        num_embeddings=100_000, features=100, mesh={axes.REPLICA: 2, axes.BATCH: 4},
        tokens=4096,
        kwargs=dict(table_axes=(axes.BATCH,), data_axes=(axes.REPLICA, axes.BATCH))),
    "GPT-2 vocab over 8": dict(
        num_embeddings=50257, features=768, mesh={axes.MODEL: 8}, tokens=4096,
        kwargs=dict(tied=True)),
    "tensor 2 x fsdp 4": dict(
        num_embeddings=32_000, features=256, mesh={"tensor": 2, "fsdp": 4}, tokens=4096,
        kwargs=dict(table_axes=("tensor",))),
}

plans = {}  # scenario -> {strategy: plan or None where it can't apply}, "auto" included
for title, s in scenarios.items():
  plans[title] = {}
  for strategy in (options.AUTO,) + options.STRATEGIES:
    try:
      plans[title][strategy] = embedlib.plan_embedding(
          s["num_embeddings"], s["features"], mesh=s["mesh"], sharding=strategy,
          tokens=s["tokens"], name=title, **s["kwargs"])
    except ValueError:  # grid needs a second group of axes for the columns
      plans[title][strategy] = None
  print(plans[title][options.AUTO], end="\n\n")

# %% [markdown]
# ## Every strategy, in numbers
#
# The auto choice is marked `*`. Padding is storage only: padded rows and columns
# are zero and never reach an output.

# %%
print(f"{'scenario':<22}{'strategy':<12}{'padded shape':<16}{'padding':>9}"
      f"{'MiB/device':>12}{'KiB moved':>12}")
for title, by_strategy in plans.items():
  for strategy in options.STRATEGIES:
    p = by_strategy[strategy]
    mark = "*" if strategy == by_strategy[options.AUTO].strategy else " "
    if p is None:
      print(f"{title:<22}{mark}{strategy:<11}(doesn't apply to this mesh and these axes)")
      continue
    print(f"{title:<22}{mark}{strategy:<11}{str(p.padded_shape):<16}"
          f"{100 * p.padding_overhead:>8.2f}%{p.bytes_per_device / 2**20:>12.2f}"
          f"{p.bytes_moved_per_lookup / 2**10:>12.1f}")

# %% [markdown]
# ## Bytes per device and bytes moved, per strategy
#
# Replicated stores the whole table everywhere and moves nothing; vocab and
# hidden store one shard each and differ in traffic: vocab sums full rows from
# every rank, hidden gathers one slice of each row. Routed sends each id to the
# rank owning its row; grid, where the mesh has a second group of axes for the
# columns, stores one block of rows and columns and does both.

# %%
fig, (ax_mem, ax_moved) = plt.subplots(1, 2, figsize=(12, 4))
x = np.arange(len(plans))
width = 0.8 / len(options.STRATEGIES)
for i, strategy in enumerate(options.STRATEGIES):
  applies = [plans[t][strategy] is not None for t in plans]
  mem = [plans[t][strategy].bytes_per_device / 2**20 for t in plans if plans[t][strategy]]
  moved = [plans[t][strategy].bytes_moved_per_lookup / 2**10 for t in plans if plans[t][strategy]]
  at = (x + (i - (len(options.STRATEGIES) - 1) / 2) * width)[applies]
  ax_mem.bar(at, mem, width, label=strategy)
  ax_moved.bar(at, moved, width, label=strategy)
for ax, label in ((ax_mem, "MiB stored per device"), (ax_moved, "KiB moved per lookup, per device")):
  ax.set_xticks(x, list(plans), rotation=15)
  ax.set_ylabel(label)
  ax.set_yscale("symlog", linthresh=1)
  ax.legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# ## The sharded layouts, built and checked
#
# Each table is built on a real mesh with the scenario's axes, as vocab, as
# hidden and as grid where they apply (replicated is a plain local lookup), and looked up with `tokens` ids
# (at most 64 here; 13 ids over 8 data shards are padded to 16 inside the
# lookup and the padding dropped), then compared with `jnp.take` on the logical
# table, and `attend` with `query @ table.T`. This needs 8 devices: the CPU
# runtime simulates them; a runtime with fewer shows the plans above only.

# %%
if jax.device_count() < 8:
  print(f"{jax.device_count()} device(s): skipping the 8-device lookups")
else:
  for title, s in scenarios.items():
    mesh = jax.make_mesh(tuple(s["mesh"].values()), tuple(s["mesh"]),
                         devices=jax.devices()[:8])
    ids = jax.random.randint(jax.random.key(0), (min(s["tokens"], 64),), 0, s["num_embeddings"])
    query = jax.random.normal(jax.random.key(1), (ids.shape[0], s["features"]))
    for strategy in (options.VOCAB, options.HIDDEN, options.GRID):
      if plans[title][strategy] is None:
        continue
      emb = embedlib.ShardedEmbed(
          s["num_embeddings"], s["features"], mesh=mesh,
          layout=embedlib.Layout(sharding=strategy, **s["kwargs"]), name=title, rngs=nnx.Rngs(0))
      assert emb.plan.padded_shape == plans[title][strategy].padded_shape
      table = np.asarray(emb.logical_table())
      np.testing.assert_array_equal(np.asarray(emb(ids)), table[np.asarray(ids)])
      np.testing.assert_allclose(np.asarray(emb.attend(query)), np.asarray(query) @ table.T,
                                 rtol=1e-5, atol=1e-4)
      print(f"{title:<22}{strategy:<8} physical {str(emb.plan.padded_shape):<14} "
            f"{ids.shape[0]} ids match jnp.take; attend matches query @ table.T")
