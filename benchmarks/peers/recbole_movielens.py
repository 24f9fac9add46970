"""RecBole 1.2.1 on its own ML-100K, one model and seed (runs in ``.peers``).

    .peers/bin/python benchmarks/peers/recbole_movielens.py --model BPR --seed 2020 \
        [--budget-s 600] [--split-out split.json]

Started by ``benchmarks/movielens.py``; prints one ``@@result <json>`` line
on stdout. The protocol is the sequential one the issue fixes: ``eval_args``
split ``{'LS': 'valid_and_test'}``, order ``TO``, mode ``full``;
``MAX_ITEM_LIST_LENGTH`` 50; SASRec with ``loss_type`` CE and no negative
sampling; everything else RecBole's defaults (Adam, lr 1e-3, batch 2048,
early stopping after 10 evals without a better valid MRR@10, the best
epoch's weights tested). The dataset is the one in RecBole's wheel
(``recbole/dataset_example/ml-100k``), which RecBole reads whatever
``data_path`` says.

The training loop is ``Trainer.fit``'s (``_train_epoch``, ``_valid_epoch``,
``early_stopping``, keep the best), written out so that a wall-clock budget
can stop it inside an epoch: past ``--budget-s`` seconds of training and
validation, no further batch is drawn; the partial epoch is validated like a
full one and the best weights so far are tested. ``epochs`` in the result
counts a partial epoch by its fraction of batches.

BPR's test is evaluated twice with the same best weights: as RecBole
evaluates a general model (a user's training and validation items left out
of the ranking, ``test``) and as it evaluates a sequential one (every item
ranked, seen or not, ``test_rank_seen``), so that BPR can be compared with
the sequential models on their own protocol too. Only the history mask
differs: RecBole's ``_full_sort_batch_eval`` is given no history index.

``--split-out`` writes the validation and test item of every user (raw ids),
for the benchmark to check that embedlib's split is RecBole's.
"""

import argparse
import copy
import json
import logging
import os
import sys
import tempfile
import time

import torch
from recbole.config import Config
from recbole.data import create_dataset, data_preparation
from recbole.utils import early_stopping, get_model, get_trainer, init_seed

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from worker_protocol import peak_rss_mib  # noqa: E402


def config_for(model: str, seed: int, checkpoint_dir: str) -> Config:
  extra = {}
  if model == "SASRec":
    extra = {"loss_type": "CE", "train_neg_sample_args": None}
  return Config(model=model, dataset="ml-100k", config_dict={
      "eval_args": {"split": {"LS": "valid_and_test"}, "order": "TO", "mode": "full",
                    "group_by": "user"},
      "metrics": ["Hit", "NDCG", "MRR", "Recall"],
      "topk": [10, 20],
      "MAX_ITEM_LIST_LENGTH": 50,
      "seed": seed,
      "use_gpu": False,
      "device": "cpu",
      "show_progress": False,
      "checkpoint_dir": checkpoint_dir,
      "state": "WARNING",
      **extra,
  })


class Budgeted:
  """Yields the loader's batches until the deadline; counts them."""

  def __init__(self, loader, deadline: float):
    self.loader, self.deadline, self.batches, self.cut = loader, deadline, 0, False

  def __len__(self):
    return len(self.loader)

  def __getattr__(self, name):
    return getattr(self.loader, name)

  def __iter__(self):
    self.batches, self.cut = 0, False
    for batch in self.loader:
      if time.perf_counter() >= self.deadline:
        self.cut = True
        return
      self.batches += 1
      yield batch


def split_of(dataset, valid_data, test_data) -> dict:
  out = {}
  for name, loader in (("valid", valid_data), ("test", test_data)):
    inter = loader._dataset.inter_feat
    users = dataset.id2token(dataset.uid_field, inter[dataset.uid_field].numpy())
    items = dataset.id2token(dataset.iid_field, inter[dataset.iid_field].numpy())
    for u, i in zip(users.tolist(), items.tolist()):
      out.setdefault(u, {})[name] = i
  return out


def rank_seen_test(trainer, test_data) -> dict:
  """The test metrics with no item left out of the ranking (RecBole's sequential protocol)."""
  full_sort = trainer._full_sort_batch_eval

  def without_history(batched_data):
    interaction, _, positive_u, positive_i = batched_data
    return full_sort((interaction, None, positive_u, positive_i))

  trainer._full_sort_batch_eval = without_history
  try:
    return trainer.evaluate(test_data, load_best_model=False)
  finally:
    del trainer._full_sort_batch_eval


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--model", required=True, choices=("BPR", "SASRec"))
  parser.add_argument("--seed", type=int, default=2020)
  parser.add_argument("--budget-s", type=float, default=None,
                      help="wall-clock seconds for training and validation")
  parser.add_argument("--threads", type=int, default=2)
  parser.add_argument("--split-out", default=None)
  args = parser.parse_args()
  torch.set_num_threads(args.threads)
  logging.disable(logging.INFO)
  split_out = os.path.abspath(args.split_out) if args.split_out else None
  with tempfile.TemporaryDirectory() as checkpoints:
    os.chdir(checkpoints)  # RecBole's trainer writes log_tensorboard/ into the working directory
    config = config_for(args.model, args.seed, checkpoints)
    init_seed(config["seed"], config["reproducibility"])
    t0 = time.perf_counter()
    dataset = create_dataset(config)
    train_data, valid_data, test_data = data_preparation(config, dataset)
    if split_out:
      with open(split_out, "w") as f:
        json.dump(split_of(dataset, valid_data, test_data), f)
    init_seed(config["seed"] + config["local_rank"], config["reproducibility"])
    model = get_model(config["model"])(config, train_data._dataset).to(config["device"])
    trainer = get_trainer(config["MODEL_TYPE"], config["model"])(config, model)
    prepare_s = time.perf_counter() - t0

    start = time.perf_counter()
    deadline = start + args.budget_s if args.budget_s else float("inf")
    loader = Budgeted(train_data, deadline)
    trainer.eval_collector.data_collect(train_data)
    best_state, best_epoch, epochs, train_total, valid_curve = None, 0, 0.0, 0.0, []
    for epoch in range(config["epochs"]):
      t = time.perf_counter()
      trainer._train_epoch(loader, epoch)
      train_s = time.perf_counter() - t
      if loader.batches == 0:
        break
      epochs += loader.batches / len(train_data)
      train_total += train_s
      score, result = trainer._valid_epoch(valid_data)
      valid_curve.append({"t": round(time.perf_counter() - start, 2), "epochs": round(epochs, 3),
                          **{k: float(v) for k, v in result.items()}})
      trainer.best_valid_score, trainer.cur_step, stop, better = early_stopping(
          score, trainer.best_valid_score, trainer.cur_step, max_step=trainer.stopping_step,
          bigger=trainer.valid_metric_bigger)
      if better:
        best_state, best_epoch = copy.deepcopy(model.state_dict()), epoch + 1
      if stop or loader.cut or time.perf_counter() >= deadline:
        break
    if best_state is not None:
      model.load_state_dict(best_state)
    test = trainer.evaluate(test_data, load_best_model=False)
    wall = time.perf_counter() - start
    test_rank_seen = rank_seen_test(trainer, test_data) if args.model == "BPR" else None
  result = {
      "model": args.model, "seed": args.seed, "budget_s": args.budget_s,
      "test": {k: float(v) for k, v in test.items()},
      **({"test_rank_seen": {k: float(v) for k, v in test_rank_seen.items()}}
         if test_rank_seen is not None else {}),
      "epochs": round(epochs, 3), "best_epoch": best_epoch, "stopped_by_budget": loader.cut,
      "wall_s": wall, "prepare_s": prepare_s,
      "s_per_epoch": train_total / epochs if epochs else None,  # training only
      "steps_per_epoch": len(train_data),
      "valid_curve": valid_curve,
      "peak_rss_mib": peak_rss_mib(), "threads": torch.get_num_threads(),
      "num_items": dataset.item_num - 1, "num_users": dataset.user_num - 1,
  }
  print("@@result " + json.dumps(result), flush=True)


if __name__ == "__main__":
  main()
