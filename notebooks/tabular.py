# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.7
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Your own files: ML-100K with every side column, DLRM against ids alone
#
# `configs/tabular.py` trains on any Parquet, CSV or RecBole files through
# their schema. Here: ML-100K as RecBole ships it (`ml-100k.inter` joined
# with `.user`: age, gender, occupation, zip code; and `.item`: release
# year, genres, title tokens), ratings of 4 or 5 as clicks, RecBole's random
# 8:1:1 split. One DLRM reads every side column, one the user and movie ids
# alone; the test AUC says what the side columns are worth. Then the run is
# exported and its artifact scores rows given by their raw values. What it
# reaches and how long it takes: `docs/guides/your_data.md`.
#
# The files come from RecBole's wheel (`pip download recbole==1.2.1
# --no-deps`, which carries them); `EMBEDLIB_ML100K` may name the `.inter`
# file instead. With `EMBEDLIB_NOTEBOOK_SMOKE=1` (CI) it trains a few steps
# on tiny generated files of the same layout.

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
import glob
import pathlib
import tempfile
import zipfile

import matplotlib.pyplot as plt
import numpy as np

from configs import tabular as tabular_config  # noqa: E402
from embedlib import serving, tabular
from embedlib.serving import tabular as served_tabular
from embedlib.training import export_lib, train_lib
from embedlib.training.writers import read_jsonl

print(notebook.runtime())

# %% [markdown]
# ## The files
#
# RecBole's atomic files type every column in their header
# (`age:token`, `class:token_seq`); the schema is read from there.

# %%
smoke = notebook.smoke()


def tiny_recbole(folder: pathlib.Path) -> pathlib.Path:
  """A few users and movies in RecBole's layout, with side columns, for a smoke run."""
  rng = np.random.default_rng(0)
  folder.mkdir(parents=True, exist_ok=True)
  inter = ["user_id:token\titem_id:token\trating:float\ttimestamp:float\n"]
  for user in range(1, 61):
    for t, item in enumerate(rng.choice(80, rng.integers(5, 20), replace=False) + 1):
      inter.append(f"{user}\t{item}\t{rng.integers(1, 6)}\t{880000000 + 3600 * t}\n")
  (folder / "ml-100k.inter").write_text("".join(inter))
  (folder / "ml-100k.user").write_text(
      "user_id:token\tage:token\tgender:token\toccupation:token\tzip_code:token\n" + "".join(
          f"{u}\t{20 + u % 30}\t{'MF'[u % 2]}\tjob{u % 5}\t{10000 + u % 7}\n"
          for u in range(1, 61)))
  genres = ("Action", "Comedy", "Drama", "Romance")
  (folder / "ml-100k.item").write_text(
      "item_id:token\tmovie_title:token_seq\trelease_year:token\tclass:token_seq\n" + "".join(
          f"{i}\tMovie {i}\t{1980 + i % 20}\t{genres[i % 4]} {genres[(i // 4) % 4]}\n"
          for i in range(1, 81)))
  return folder / "ml-100k.inter"


def recbole_ml100k() -> pathlib.Path:
  """ML-100K's atomic files out of RecBole's wheel (PyPI only, no other download)."""
  folder = pathlib.Path(tempfile.mkdtemp())
  subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d",
                  str(folder), "recbole==1.2.1"], check=True)
  wheel = zipfile.ZipFile(glob.glob(str(folder / "recbole-*.whl"))[0])
  names = [n for n in wheel.namelist()
           if "dataset_example/ml-100k/ml-100k." in n and n[-5:] in (".user", ".item", "inter")]
  wheel.extractall(folder, names)
  return folder / "recbole" / "dataset_example" / "ml-100k" / "ml-100k.inter"


if smoke:
  path = tiny_recbole(pathlib.Path(tempfile.mkdtemp()) / "ml-100k")
elif "EMBEDLIB_ML100K" in os.environ:
  path = pathlib.Path(os.environ["EMBEDLIB_ML100K"])
else:
  path = recbole_ml100k()
print("data:", path)

# %% [markdown]
# ## The schema
#
# Inferred from the headers, with the label declared: `rating >= 4` is a
# click. Each id column is read through a vocabulary of the training rows'
# values (a dynamic table of raw ids past 100,000 distinct ones).

# %%
data = tabular.prepare(str(path), tabular.Hints(labels=("rating",)),
                       split=tabular.Split("hash", eval_fraction=0.1, test_fraction=0.1),
                       label_threshold=4.0)
print(data.schema.describe())

# %% [markdown]
# ## Train: every side column, then ids alone
#
# The same config twice; the second ignores the side columns. Each run
# evaluates once an epoch and stops after `early_stopping` evals without a
# better AUC, then scores its test rows with the best eval's weights.

# %%
SIDE = ("age", "gender", "occupation", "zip_code", "movie_title", "release_year", "class")


def run(ignore: tuple) -> tuple[str, dict]:
  config = tabular_config.get_config(f"smoke,{path}" if smoke else str(path))
  config.data.label = "rating"
  config.data.label_threshold = 4.0
  config.data.ignore = ",".join(ignore)
  workdir = notebook.fresh_workdir("tabular")
  return workdir, train_lib.train_and_evaluate(config, workdir)


side_dir, side = run(())
ids_dir, ids = run(SIDE)
for name, result in (("every side column", side), ("ids alone", ids)):
  print(f"{name:18s} test AUC {result['test_auc']:.4f}  log-loss {result['test_logloss']:.4f}")

# %%
fig, ax = plt.subplots(figsize=(7, 4))
for name, workdir in (("every side column", side_dir), ("ids alone", ids_dir)):
  evals = read_jsonl(os.path.join(workdir, "eval.jsonl"))
  ax.plot([e["step"] for e in evals], [e["auc"] for e in evals], "o-", label=name)
ax.set_xlabel("step")
ax.set_ylabel("eval AUC")
ax.legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Serve: export, then score rows by their raw values
#
# The artifact carries the schema and the vocabularies; a server reads a
# file, or columns given by name, as the run did, with jax, numpy and
# pyarrow alone.

# %%
config, model, mesh = export_lib.restore(side_dir)
artifact = os.path.join(tempfile.mkdtemp(), "artifact")
export_lib.export(config, model, mesh, artifact, workdir=side_dir)
served = serving.load(artifact)
rows = {"user_id": ["1", "2"], "item_id": ["1", "50"], "timestamp": [None, None],
        "age": ["24", "53"], "gender": ["M", "F"], "occupation": ["technician", "other"],
        "zip_code": ["85711", "94043"], "movie_title": [["Toy", "Story"], ["Star", "Wars"]],
        "release_year": ["1995", "1977"], "class": [["Animation", "Comedy"], ["Action"]]}
print(served_tabular.score_columns(served, rows))
first = next(served_tabular.score_file(served, str(path)))
print("first rows of the file:", np.round(first["probability"][:5], 4))
