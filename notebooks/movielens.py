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
# # SASRec on MovieLens: train, watch validation, read a user's next movies
#
# `configs/movielens.py` trains a next-item model on a MovieLens release:
# each user's ratings in time order, the last one held out for test and the
# one before it for validation. The model reads a user's last 50 movies and
# scores every movie as the next one, through the item table itself (a
# softmax over the whole catalogue); the eval ranks each held-out movie
# among all of them (HR, NDCG and MRR at 10 and 20). What it reaches on
# ML-100K and how long it takes: `docs/guides/movielens.md`.
#
# On Colab this downloads ML-100K from GroupLens; elsewhere set
# `EMBEDLIB_MOVIELENS` to a MovieLens folder or ratings file. With
# `EMBEDLIB_NOTEBOOK_SMOKE=1` (CI) it trains the smoke config a few steps on
# a tiny generated file instead.

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
import pathlib
import tempfile
import urllib.request
import zipfile

import matplotlib.pyplot as plt
import numpy as np
from flax import nnx

from configs import movielens  # noqa: E402
from embedlib import data as data_lib
from embedlib.data.next_item import NextItemSource
from embedlib.training import setup, train_lib
from embedlib.training.writers import read_jsonl

print(notebook.runtime())

# %% [markdown]
# ## The data
#
# Any MovieLens release as it unzips (ML-100K's folder, ML-1M's
# `ratings.dat`, ML-20M's `ratings.csv`, ...) or RecBole's atomic files.

# %%
smoke = notebook.smoke()
GROUPLENS = "https://files.grouplens.org/datasets/movielens/ml-100k.zip"


def tiny_ml100k(folder: pathlib.Path) -> pathlib.Path:
  """A few users in ML-100K's layout (`u.data`, `u.item`), for a smoke run."""
  rng = np.random.default_rng(0)
  folder.mkdir(parents=True, exist_ok=True)
  rows = []
  for user in range(1, 41):
    for t, item in enumerate(rng.choice(60, rng.integers(5, 16), replace=False) + 1):
      rows.append(f"{user}\t{item}\t{rng.integers(1, 6)}\t{880000000 + 3600 * t}\n")
  (folder / "u.data").write_text("".join(rows))
  (folder / "u.item").write_text("".join(
      f"{i}|Movie {i} (1995)|01-Jan-1995||http://x|" + "|".join("0" * 19) + "\n"
      for i in range(1, 61)), encoding="latin-1")
  return folder


if smoke:
  path = tiny_ml100k(pathlib.Path(tempfile.mkdtemp()) / "ml-100k")
elif "google.colab" in sys.modules and "EMBEDLIB_MOVIELENS" not in os.environ:
  archive, _ = urllib.request.urlretrieve(GROUPLENS, "/content/ml-100k.zip")
  zipfile.ZipFile(archive).extractall("/content")
  path = pathlib.Path("/content/ml-100k")
else:
  path = pathlib.Path(os.environ.get("EMBEDLIB_MOVIELENS", "ml-100k"))
print("MovieLens data:", path)

# %% [markdown]
# ## Train
#
# The config is a plain `ConfigDict`: change any value before the call (the
# HSTU encoder: `movielens.get_config(f"hstu,{path}")`). A fresh workdir
# each time (an existing one would resume from its last checkpoint).

# %%
config = movielens.get_config(notebook.config_arg(str(path)))
config.data.path = str(path)
workdir = notebook.fresh_workdir("movielens")
print(f"{config.model.name}: {config.num_train_steps} steps of {config.batch_size} windows, "
      f"workdir {workdir}")
result = train_lib.train_and_evaluate(config, workdir)
print({k: round(v, 4) for k, v in result.items()})

# %% [markdown]
# ## The validation curve
#
# Each eval ranks every user's validation movie among all movies; the test
# movie is ranked once, at the end (dashed).

# %%
evals = read_jsonl(os.path.join(workdir, "eval.jsonl"))
train_log = read_jsonl(os.path.join(workdir, "train.jsonl"))
fig, (ax_loss, ax_rank) = plt.subplots(1, 2, figsize=(12, 4))
ax_loss.plot([r["step"] for r in train_log], [r["loss"] for r in train_log])
ax_loss.set_xlabel("step")
ax_loss.set_ylabel("training loss (softmax over every movie)")
for key, color in (("ndcg@10", "C0"), ("hr@10", "C1")):
  ax_rank.plot([e["step"] for e in evals], [e[key] for e in evals], "o-", color=color,
               label=f"validation {key}")
  ax_rank.axhline(evals[-1][f"test_{key}"], color=color, linestyle="--", label=f"test {key}")
ax_rank.set_xlabel("step")
ax_rank.legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# ## A few users: their last movies, and the model's next ten
#
# Restore the final checkpoint, read each user's history before the test
# movie, and rank every movie by the model's score. (The model may rank a
# movie the user has already rated: RecBole evaluates sequential models that
# way, and so does `config.task.mask_seen=False`.)

# %%
model, mesh = setup.restore_model(config, workdir)
task = setup.task(config)

split = task.split  # the file's leave-one-out split, read once
rows = NextItemSource(split, max_len=config.data.max_len, batch_size=config.batch_size,
                      kind="test").batch(0)
batch = data_lib.to_global_batch(task.featurize(rows), mesh)
scores = np.array(nnx.jit(lambda m, b: m.logits(m(b)[:, -1], b["items"]))(model, batch))
scores[:, 0] = -np.inf  # row 0 is padding, never a movie
title = lambda item: split.item_titles.get(int(item), f"item {int(item)}")

for user in range(3):
  history = [title(i) for i in rows["items"][user] if i > 0][-5:]
  top = np.argsort(-scores[user])[:10]
  held_out = rows["target"][user]
  print(f"user {user}: last movies {history}")
  rank = int((scores[user] > scores[user, held_out]).sum()) + 1
  print(f"  held out: {title(held_out)} (ranked {rank})")
  for place, item in enumerate(top, 1):
    print(f"  {place:2d}. {title(item)}{'  <- held out' if item == held_out else ''}")
