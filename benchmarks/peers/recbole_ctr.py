"""RecBole 1.2.1's context-aware (CTR) models on a given split of ML-100K (runs in ``.peers``).

    TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 .peers/bin/python benchmarks/peers/recbole_ctr.py \
        --model DeepFM --seed 2020 --data-path DIR --dataset NAME [--columns ours|preset]

Started by ``benchmarks/tabular_movielens.py``, which writes the split as
RecBole benchmark files: ``DIR/NAME/NAME.{train,valid,test}.inter`` and
``NAME.user`` / ``NAME.item``. With ``benchmark_filename: [train, valid,
test]`` RecBole reads the three files as its three parts, in order, and
neither filters nor shuffles nor splits the rows (``Dataset.build``,
``Dataset._data_processing`` skip it for benchmark files); the label is
``rating >= 4`` (``threshold: {rating: 4}``), the rows kept.

Settings: RecBole's own for context-aware models (``quick_start_config/
context-aware.yaml``: ``eval_args`` mode ``labeled``, no negative sampling,
metrics AUC and LogLoss, valid metric AUC) and each model's yaml, with
RecBole's defaults for the rest (Adam, lr 1e-3, batch 2048, up to 300
epochs, early stopping after 10 evals without a better valid AUC, the best
epoch's weights tested). ``--columns``: ``ours`` reads the side columns
embedlib reads (user age, gender, occupation, zip code; item release year,
genres, title tokens); ``preset`` those of RecBole's ML-100K preset
(``context-aware_ml-100k.yaml``: no zip code, no title; it applies only to
a dataset named ``ml-100k``, so it is spelt out here).

Prints one ``@@result <json>`` line: the test metrics, the parts' rows and
clicks (for the benchmark to check the split), epochs, wall seconds (from
reading the files to the test metrics), peak RSS.
"""

import argparse
import json
import logging
import os
import sys
import tempfile
import time

import torch
from recbole.config import Config
from recbole.data import create_dataset, data_preparation
from recbole.utils import get_model, get_trainer, init_seed

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from worker_protocol import peak_rss_mib  # noqa: E402

COLUMNS = {
    "ours": {"inter": ["user_id", "item_id", "rating"],
             "user": ["user_id", "age", "gender", "occupation", "zip_code"],
             "item": ["item_id", "movie_title", "release_year", "class"]},
    "preset": {"inter": ["user_id", "item_id", "rating", "timestamp"],
               "user": ["user_id", "age", "gender", "occupation"],
               "item": ["item_id", "release_year", "class"]},
}


def config_for(args, checkpoint_dir: str) -> Config:
  extra = {"epochs": 1} if args.smoke else {}
  return Config(model=args.model, dataset=args.dataset, config_dict={
      "data_path": args.data_path,
      "benchmark_filename": ["train", "valid", "test"],
      "threshold": {"rating": 4},
      "load_col": COLUMNS[args.columns],
      "seed": args.seed,
      "use_gpu": False,
      "device": "cpu",
      "show_progress": False,
      "checkpoint_dir": checkpoint_dir,
      "state": "WARNING",
      **extra,
  })


def parts_of(loaders, label_field: str) -> dict:
  """``{part: {"rows", "clicks"}}`` of the loaders' datasets."""
  out = {}
  for name, loader in zip(("train", "valid", "test"), loaders):
    inter = loader._dataset.inter_feat
    out[name] = {"rows": len(inter), "clicks": int(inter[label_field].sum().item())}
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--model", required=True, help="a context-aware model, e.g. DeepFM")
  parser.add_argument("--seed", type=int, default=2020)
  parser.add_argument("--data-path", required=True)
  parser.add_argument("--dataset", required=True)
  parser.add_argument("--columns", choices=tuple(COLUMNS), default="ours")
  parser.add_argument("--threads", type=int, default=2)
  parser.add_argument("--smoke", action="store_true", help="one epoch")
  args = parser.parse_args()
  args.data_path = os.path.abspath(args.data_path)
  torch.set_num_threads(args.threads)
  logging.disable(logging.INFO)
  with tempfile.TemporaryDirectory() as checkpoints:
    os.chdir(checkpoints)  # RecBole's trainer writes log_tensorboard/ into the working directory
    config = config_for(args, checkpoints)
    init_seed(config["seed"], config["reproducibility"])
    start = time.perf_counter()
    dataset = create_dataset(config)
    loaders = data_preparation(config, dataset)
    train_data, valid_data, test_data = loaders
    init_seed(config["seed"] + config["local_rank"], config["reproducibility"])
    model = get_model(config["model"])(config, train_data._dataset).to(config["device"])
    trainer = get_trainer(config["MODEL_TYPE"], config["model"])(config, model)
    prepare_s = time.perf_counter() - start
    epochs = []
    train_epoch = trainer._train_epoch

    def counted(*a, **kw):
      epochs.append(1)
      return train_epoch(*a, **kw)

    trainer._train_epoch = counted
    best_valid, _ = trainer.fit(train_data, valid_data, saved=True, show_progress=False)
    test = trainer.evaluate(test_data, load_best_model=True, show_progress=False)
    wall = time.perf_counter() - start
    fields = {"user": sorted(f for f in dataset.field2source
                             if str(dataset.field2source[f]).endswith("USER")),
              "item": sorted(f for f in dataset.field2source
                             if str(dataset.field2source[f]).endswith("ITEM"))}
    result = {
        "model": args.model, "seed": args.seed, "columns": args.columns,
        "test": {k.lower(): float(v) for k, v in test.items()},
        "best_valid_auc": float(best_valid), "epochs": len(epochs),
        "wall_s": wall, "prepare_s": prepare_s, "parts": parts_of(loaders, dataset.label_field),
        "fields": fields, "params": sum(p.numel() for p in model.parameters()),
        "peak_rss_mib": peak_rss_mib(), "threads": torch.get_num_threads(),
    }
  print("@@result " + json.dumps(result), flush=True)


if __name__ == "__main__":
  main()
