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
# # Train the transformer ranker, watch each action learn, check candidate isolation
#
# `configs/ranker.py` trains a transformer over `[user | history | candidates]`
# on planted ranking requests: each candidate gets 5 action logits (click,
# like, reply, share, dwell), and the labels come from a hidden model whose
# per-action AUC and NDCG are known (`oracle_*`). Its time and metrics are in
# the config's docstring; set `EMBEDLIB_NOTEBOOK_SMOKE=1` for a few steps of a
# tiny model (CI does).
#
# Candidates attend only to the user, the history and themselves, and share
# one position, so a candidate's scores can't depend on which other
# candidates share its request. The last cells check that on the trained
# model.

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
import matplotlib.pyplot as plt
import numpy as np

from configs import ranker  # noqa: E402
from embedlib import data as data_lib
from embedlib.training import setup, steps, train_lib
from embedlib.training.writers import read_jsonl

print(notebook.runtime())

# %% [markdown]
# ## Train
#
# A fresh workdir each time (an existing one would resume from its last
# checkpoint). The log prints the planted optimum on the eval set first.

# %%
config = ranker.get_config(notebook.config_arg())
workdir = notebook.fresh_workdir("ranker")
print(f"ranker: {config.num_train_steps} steps of {config.batch_size} requests, "
      f"workdir {workdir}")

result = train_lib.train_and_evaluate(config, workdir)
actions = list(config.data.actions)
ndcg = f"ndcg@{config.task.ndcg_k}"
for key in [f"auc/{a}" for a in actions] + ["auc_mean", ndcg]:
  print(f"{key:12s} model {result[key]:.4f}   planted optimum {result['oracle_' + key]:.4f}")

# %% [markdown]
# ## Per-action curves
#
# `eval.jsonl` holds each eval's per-action AUC and NDCG beside the oracle's
# (dashed); `train.jsonl` the training loss.

# %%
train_log = read_jsonl(os.path.join(workdir, "train.jsonl"))
eval_log = read_jsonl(os.path.join(workdir, "eval.jsonl"))
eval_steps = [r["step"] for r in eval_log]

fig, (ax_loss, ax_auc, ax_ndcg) = plt.subplots(1, 3, figsize=(15, 4))
ax_loss.plot([r["step"] for r in train_log], [r["loss"] for r in train_log])
ax_loss.set_title("training loss (weighted sigmoid CE)")
ax_loss.set_xlabel("step")
for i, action in enumerate(actions):
  color = f"C{i}"
  ax_auc.plot(eval_steps, [r[f"auc/{action}"] for r in eval_log], "o-", color=color,
              label=action)
  ax_auc.axhline(eval_log[-1][f"oracle_auc/{action}"], color=color, linestyle="--")
ax_auc.set_title("eval AUC per action (dashed: planted optimum)")
ax_auc.set_xlabel("step")
ax_auc.legend()
ax_ndcg.plot(eval_steps, [r[ndcg] for r in eval_log], "o-", label="model")
ax_ndcg.axhline(eval_log[-1][f"oracle_{ndcg}"], color="gray", linestyle="--", label="optimum")
ax_ndcg.set_title(f"eval {ndcg} on weighted actions")
ax_ndcg.set_xlabel("step")
ax_ndcg.legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Candidate isolation
#
# Restore the trained model, take a batch of eval requests, and score it three
# ways: as it is, with its candidates in reverse order, and with every other
# candidate removed (its slot padded). Each remaining candidate keeps its
# logits, up to float rounding.

# %%
task = setup.task(config)
spec = task.data_spec()
model, mesh = setup.restore_model(config, workdir)
_, eval_source = setup.sources(config, task, spec)
batch = task.featurize(next(eval_source))


def scores(batch):
  return np.asarray(steps.eval_step(model, data_lib.to_global_batch(batch, mesh), task=task))


def with_candidates(batch, order):
  """The batch holding only candidates ``order`` (-1: a padded slot), in that order."""
  out = dict(batch)
  for key in ("candidate_item", "candidate_author", "labels"):
    picked = batch[key][:, np.maximum(order, 0)]
    keep = (np.asarray(order) >= 0).reshape((1, -1) + (1,) * (picked.ndim - 2))
    out[key] = np.where(keep, picked, -1 if key != "labels" else 0).astype(batch[key].dtype)
  return out


c = spec.num_candidates
full = scores(batch)
reverse = scores(with_candidates(batch, list(range(c))[::-1]))[:, ::-1]
kept = list(range(0, c, 2))
thinned = scores(with_candidates(batch, [i if i in kept else -1 for i in range(c)]))
real = batch["candidate_item"] >= 0
print(f"max |change| over real candidates: reversed order {np.abs(reverse - full)[real].max():.1e}, "
      f"every other candidate removed {np.abs(thinned - full)[:, kept][real[:, kept]].max():.1e}")
np.testing.assert_allclose(reverse, full, rtol=1e-5, atol=1e-5)
np.testing.assert_allclose(thinned[:, kept], full[:, kept], rtol=1e-5, atol=1e-5)

# %% [markdown]
# One request's candidates, scored in their original order and reversed (the
# bars coincide), next to what a different history does to them: isolation
# separates candidates from each other, not from the user's history.

# %%
other_history = dict(batch, history_item=np.roll(batch["history_item"], 1, axis=0),
                     history_author=np.roll(batch["history_author"], 1, axis=0),
                     history_actions=np.roll(batch["history_actions"], 1, axis=0))
moved = scores(other_history)
request = int(np.argmax(real.sum(1)))
n = int(real[request].sum())
like = actions.index("like")
x = np.arange(n)
fig, ax = plt.subplots(figsize=(10, 3.5))
ax.bar(x - 0.27, full[request, :n, like], 0.27, label="as served")
ax.bar(x, reverse[request, :n, like], 0.27, label="candidates reversed")
ax.bar(x + 0.27, moved[request, :n, like], 0.27, label="another user's history")
ax.set_xlabel("candidate")
ax.set_ylabel("'like' logit")
ax.set_title(f"request {request}: {n} candidates")
ax.legend()
plt.show()
