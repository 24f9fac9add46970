"""What a trained next-item model puts in a user's top ten: how many movies it has read.

    python -m train --config configs/movielens.py:/work/data/ml-100k --workdir DIR --cpu_devices=1
    python3 benchmarks/movielens_top10.py DIR
    python3 benchmarks/movielens_top10.py DIR --json run.json   # also the run's record (timing.Run)

Restores ``DIR``'s last checkpoint (``configs/movielens.py``'s SASRec or
HSTU), ranks every user's test movie among all movies with seen movies
ranked (RecBole's protocol for sequential models), and prints:

- test HR@10 and NDCG@10 as trained (the figures in ``eval.jsonl``);
- the share of the top ten that is in the model's input (the last
  ``max_len`` movies it read) and in the user's whole history;
- NDCG@10 with the input's movies left out of the ranking, and with the
  whole history left out (``config.task.mask_seen=True``);
- the learned repeat bias, where the model has one (``model.repeat_bias``).

A MovieLens user never rates a movie twice, so every seen movie in a top ten
is a wasted place. Runs on CPU (``--cpu_devices`` as trained: one device).
``--json FILE`` keeps these figures (``benchmarks/timing.py``'s record, no
timing: the machine's state is recorded all the same), with the named
ratios ``input_left_out_over_ranked`` and ``history_left_out_over_ranked``
(NDCG@10 with those movies left out over NDCG@10 as ranked).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(1, HERE)

import jax  # noqa: E402
import ml_collections  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from embedlib import data as data_lib  # noqa: E402
from embedlib.data.next_item import TEST, NextItemSource  # noqa: E402
from embedlib.metrics import full_ranking  # noqa: E402
from embedlib.training import setup  # noqa: E402
import timing  # noqa: E402


def load_config(workdir: str):
  """The run's ``config.json`` as the ``ConfigDict`` it came from (lists back to tuples)."""
  with open(os.path.join(workdir, "config.json"), encoding="utf-8") as f:
    config = ml_collections.ConfigDict(json.load(f))
  config.task.ks = tuple(config.task.ks)
  config.mesh_axes, config.mesh_shape = tuple(config.mesh_axes), tuple(config.mesh_shape)
  return config


def test_scores(config, workdir: str):
  """Every user's scores of every item (padding at -inf), test target, input row and history."""
  model, mesh = setup.restore_model(config, workdir)
  task = setup.task(config)
  source = NextItemSource(task.split, max_len=config.data.max_len,
                          batch_size=config.batch_size, kind=TEST, exclude_seen=True)
  score = nnx.jit(lambda m, b: m.logits(m(b)[:, -1], b["items"]))
  scores, targets, inputs, histories = [], [], [], []
  for index in range(source.num_batches):
    rows = source.batch(index)
    batch = data_lib.to_global_batch(task.featurize(rows), mesh)
    scores.append(np.asarray(score(model, batch)))
    targets.append(rows["target"])
    inputs.append(rows["items"])
    histories.append(rows["exclude"])
  users = source.num_users
  scores = np.concatenate(scores)[:users]
  scores[:, 0] = -np.inf
  rows = [np.concatenate(a)[:users] for a in (targets, inputs, histories)]
  return scores, *rows, model.embed.repeat_logit


def ndcg_hr(scores, targets, exclude=None):
  ranks = full_ranking.target_ranks(scores, targets, exclude=exclude)
  per_row = full_ranking.metrics_of_ranks(ranks, ks=(10,))
  return float(per_row["ndcg@10"].mean()), float(per_row["hr@10"].mean())


def share_in(top, rows) -> float:
  """The mean share of each row's ``top`` items found among its nonzero ``rows`` items."""
  return float(np.mean([np.isin(t, row[row > 0]).mean() for t, row in zip(top, rows)]))


def measure(workdir: str) -> dict:
  """The module docstring's figures for ``workdir``'s last checkpoint."""
  config = load_config(workdir)
  scores, targets, inputs, histories, logit = test_scores(config, workdir)
  top = np.argsort(-scores, axis=1, kind="stable")[:, :10]
  return {
      "model": config.model.name, "max_len": config.data.max_len, "users": len(targets),
      "repeat_logit": logit,
      "ranked": ndcg_hr(scores, targets),
      "in_input": share_in(top, inputs),
      "in_history": share_in(top, histories),
      "input_left_out": ndcg_hr(scores, targets, inputs),
      "history_left_out": ndcg_hr(scores, targets, histories),
  }


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("workdir", help="a finished `python -m train` run of configs/movielens.py")
  timing.add_json_argument(parser)
  args = parser.parse_args(argv)
  record = timing.Run("movielens_top10", argv)
  jax.config.update("jax_platforms", "cpu")
  m = measure(args.workdir)
  bias = "off" if m["repeat_logit"] is None else f"{m['repeat_logit']:+.2f} (logit)"
  print(f"{args.workdir}: {m['model']}, repeat bias {bias}; {m['users']} users")
  print("  test NDCG@10 %.4f  HR@10 %.4f  (seen movies ranked)" % m["ranked"])
  print(f"  top ten: {100 * m['in_input']:.1f}% from the model's input ({m['max_len']} "
        f"movies), {100 * m['in_history']:.1f}% from the user's history")
  print("  test NDCG@10 %.4f  HR@10 %.4f  (the input's movies left out)" % m["input_left_out"])
  print("  test NDCG@10 %.4f  HR@10 %.4f  (the whole history left out)" % m["history_left_out"])
  for key in ("ranked", "input_left_out", "history_left_out"):
    record.add_case(f"test ndcg@10, {key.replace('_', ' ')}", m[key][0], "ndcg@10")
    record.add_case(f"test hr@10, {key.replace('_', ' ')}", m[key][1], "hr@10")
  record.add_case("top ten share in the input", m["in_input"], "share")
  record.add_case("top ten share in the history", m["in_history"], "share")
  for key in ("input_left_out", "history_left_out"):
    record.ratio(f"{key}_over_ranked", m[key][0] / m["ranked"][0])
  record.note(f"{m['model']} from {args.workdir}, {m['users']} users")
  record.finish(args.json)


if __name__ == "__main__":
  main()
