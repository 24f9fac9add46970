"""Every key of ``configs/*.py``, explained once: the "Config keys" table of the training guide.

The keys and each config's values come from the configs themselves
(``get_config()`` of every ``configs/NAME.py`` but ``parts.py``, and of the
variants in ``VARIANTS``, whose keys the default lacks); only the
explanations are written here, one per key (``*`` matches any part of a
name, so the user and item hashes share theirs). ``tests/test_docs.py``
checks that every key has exactly one explanation and every explanation a
key.
"""

import fnmatch
import importlib
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]

EXPLAINED = {
    # The run
    "seed": "Seed of the model's initialisation and of the planted data.",
    "mesh_shape": "Shape of the device mesh; one `-1` stands for the devices the other "
                  "axes leave.",
    "mesh_axes": "Names of the mesh axes, one per `mesh_shape` entry. `batch` (or `data`) "
                 "is a data axis: the batch is split over it and tables span it.",
    "batch_size": "Examples (or requests) per global batch, over all processes.",
    "num_train_steps": "Steps to train; a rerun of a finished workdir stops at once.",
    "log_every": "Steps between lines of `train.jsonl` (loss, examples/s) and the log.",
    "eval_every": "Steps between evals (`eval.jsonl`); the last step always evaluates.",
    "eval_batches": "Batches in each eval.",
    "checkpoint_every": "Steps between checkpoints; the last step and a stop by signal "
                        "save one too.",
    "early_stopping": "Evals without a better eval metric before the run stops (0: off); "
                      "the test rows are then scored with the best eval's weights.",
    "max_checkpoints": "Checkpoints kept; older ones are deleted.",
    "pipeline": "Pipelined train step: step N's program also distributes batch N+1's "
                "ids (bucketing, dedup, their all_to_all or all_gather), so the exchange "
                "can run under step N's compute; the same training bit for bit. The "
                "data source is read one batch ahead (see the training guide).",
    "early_fetch": "With `pipeline`: 0, or also fetch the next batch's rows of routed "
                   "and vocab tables in step N, before its update, and send the rows that "
                   "update changed again at step N+1 (the same training bit for bit): the "
                   "share of each rank's rows (a route's slots, a vocab table's tokens) "
                   "those corrected rows may take before a step sends every row again.",
    # The task: batch layout, loss, metrics
    "task.name": "`ctr` (one click label per example), `ranking` (several actions per "
                 "candidate), `retrieval` (one engaged item per request, in-batch "
                 "negatives), `sequential` (each user's next item, a softmax over every "
                 "item) or `tabular` (your own files, by their schema): the batch layout, "
                 "the loss and the eval metrics.",
    "task.mask_seen": "MovieLens, full ranking (sequential models, two towers): leave the "
                      "items a user has already rated out of the eval's ranking (RecBole "
                      "does for BPR, not for sequential models).",
    "task.ks": "MovieLens, full ranking (sequential models, two towers): the K of each "
               "HR@K, NDCG@K and MRR@K the eval reports.",
    "task.loss_weights": "Weight of each action's sigmoid cross-entropy, one per "
                         "`data.actions` entry.",
    "task.ndcg_weights": "Gain of each action in the NDCG label (a reply or a share counts "
                         "more than a click), one per `data.actions` entry.",
    "task.ndcg_k": "K of the eval's NDCG@K over each request's candidates.",
    "task.log_q": "Log-Q correction of the in-batch softmax: `streaming` (a frequency "
                  "estimate kept in the model and checkpointed), `batch` (each item's "
                  "count in the batch) or `none`.",
    "task.remove_accidental_hits": "Mask an in-batch negative that is the request's own "
                                   "positive item.",
    "task.recall_ks": "The K of each recall@K the eval reports.",
    "task.frequency_buckets": "Buckets of the streaming frequency estimate.",
    "task.frequency_alpha": "Update rate of the streaming frequency estimate.",
    "task.corpus_chunk": "Catalogue items embedded per call when an eval embeds them all.",
    # Data
    "data.source": "Where batches come from: `synthetic` (planted CTR data), `criteo` "
                   "(TSV files), `planted_ranking`, `planted_retrieval` or `movielens` "
                   "(a MovieLens release or RecBole's atomic files).",
    "data.path": "MovieLens: the release's folder or ratings file (any GroupLens format, "
                 "or RecBole's `.inter`). Tabular: a Parquet file, directory or glob, a "
                 "CSV / TSV file with a header, or a RecBole `.inter` file (with its "
                 "`.user` / `.item`).",
    "data.max_len": "Sequential: the most history items a row holds (SASRec's window).",
    "data.stride": "Sequential: targets per training window (at most `data.max_len`); the "
                   "window's earlier items are context only.",
    "data.num_dense": "Dense features per example.",
    "data.table_sizes": "Rows of each categorical feature's table, one per feature.",
    "data.bag_sizes": "Ids per example of each feature (1: one-hot; more: a multi-hot "
                      "bag pooled with `model.combiner`); empty for all one-hot.",
    "data.zipf_exponent": "Popularity skew of the planted ids (rank r drawn with weight "
                          "about `r ** -zipf_exponent`).",
    "data.signal_scale": "Strength of the planted CTR signal: below 1 is harder (oracle "
                         "AUC nearer 0.5), above 1 easier.",
    "data.train_path": "Criteo: the training TSV (plain or `.gz`), or with "
                       "`data.format='binary'` its binary directory.",
    "data.format": "Criteo: `tsv` (the text files) or `binary` (a directory written once "
                   "from them by `python -m embedlib.data.criteo_binary`, read "
                   "memory-mapped). Tabular: `auto` (by the files' suffixes), `parquet`, "
                   "`csv` or `recbole`.",
    "data.workers": "Criteo TSV and tabular files: grain worker processes parsing the "
                    "training lines (plain TSV) or chunks; 0 parses in the trainer's "
                    "process. Batches and checkpoints are the same for every count.",
    "data.eval_path": "Criteo: the eval TSV; set this or `data.eval_holdout`, not both. "
                      "Tabular: files of their own to evaluate on (the split is then by "
                      "file).",
    "data.test_path": "Tabular: files of their own scored once at the end (`test_*`).",
    "data.delimiter": "Tabular CSV: the field separator (empty: `,`, or a tab for `.tsv`).",
    "data.list_separator": "Tabular CSV: the separator of a list column's values.",
    "data.label": "Tabular: the label column, or several (`a,b`: one output and AUC each).",
    "data.label_threshold": "Tabular: a label `>=` this reads 1, below it 0 (RecBole's "
                            "`threshold`); None keeps the values (0 / 1).",
    "data.user_id": "Tabular: the user id column (empty: the column named `user_id`, if any).",
    "data.item_id": "Tabular: the item id column (empty: the column named `item_id`, if any).",
    "data.timestamp": "Tabular: the timestamp column (empty: the one named `timestamp`).",
    "data.user_columns": "Tabular: columns describing the user (the two towers' user "
                         "side); a RecBole `.user` file's are.",
    "data.item_columns": "Tabular: columns describing the item (the item tower's); a "
                         "RecBole `.item` file's are. SASRec / HSTU: the `.item` file's "
                         "token columns read beside each item's id.",
    "data.dense": "Tabular: int columns to read as dense numbers rather than ids.",
    "data.columns": "Tabular: `{column: {field: value}}` over the inferred schema (a "
                    "column's role, dtype, ids, num_embeddings, min_count, transform, null, "
                    "default, weights, max_len), a dict or JSON on the command line.",
    "data.ignore": "Tabular: columns no model reads.",
    "data.split": "Tabular: `hash` (a hash of the row number, `data.eval_fraction` and "
                  "`data.test_fraction`) or `time` (`data.split_time`, `data.test_time`).",
    "data.eval_fraction": "Tabular hash split: the share of rows evaluated on.",
    "data.test_fraction": "Tabular hash split: the share of rows tested on at the end.",
    "data.split_time": "Tabular time split: rows before it train, the rest evaluate.",
    "data.test_time": "Tabular time split: rows from it on test (0: none).",
    "data.split_seed": "Tabular hash split: the seed of the rows' hash.",
    "data.num_epochs": "Tabular: passes over the training rows when `num_train_steps` is 0 "
                       "(then `eval_every` and `checkpoint_every` 0 mean once an epoch).",
    "data.eval_holdout": "Criteo: fraction of the training lines held out of training "
                         "for eval, instead of `data.eval_path`.",
    "data.max_bad_lines": "Criteo: malformed lines skipped (each logged) before the run "
                          "stops; `-1` skips them all.",
    "data.raw_ids": "Read categorical values as raw ids into dynamic tables "
                    "(`model.dynamic`) instead of hashing them mod `data.table_sizes` "
                    "(DLRM and DCN), or MovieLens' own user and movie ids instead of "
                    "dense numbers (the ranker, the two towers, SASRec and HSTU).",
    "model.dynamic.capacity": "Rows of each dynamic table (`data.raw_ids`); 0 takes "
                              "`data.table_sizes`. A multiple of `bucket_size` times the "
                              "devices of the table axes.",
    "model.dynamic.bucket_size": "Slots per bucket of a dynamic table; each bucket admits "
                                 "and evicts on its own.",
    "model.dynamic.admit_after": "Sightings (1 to 255) before a raw id gets a row; until "
                                 "then it reads the default row.",
    "model.dynamic.eviction": "`lru`, `lfu` or `none` (a full bucket turns newcomers "
                              "away to the default row).",
    "model.dynamic.decay_every": "Steps between halvings of LFU scores and admission "
                                 "counts; 0: never.",
    "model.dynamic.default": "What a raw id without a row reads: `zero` or `learned` "
                             "(one learned row per table).",
    "model.dynamic.*.*": "The MovieLens models' dynamic tables, one entry per table "
                         "(`item`, required with `data.raw_ids`, SASRec's and HSTU's only "
                         "one, tied to the output; `user`, the ranker and two towers', else "
                         "hashed): the keys of `model.dynamic`, `capacity` required.",
    "data.prefetch": "Batches a background thread prepares ahead of the step.",
    "data.num_users": "Users of the planted request world.",
    "data.num_items": "Items of the planted catalogue.",
    "data.num_authors": "Authors of the planted items.",
    "data.num_topics": "Topics the planted items and users' interests fall into.",
    "data.history_len": "Most history events per request (longer histories are an error "
                        "naming this key).",
    "data.num_candidates": "Most candidates per ranking request (MovieLens: the movie "
                           "rated next and `num_candidates - 1` unrated ones per training "
                           "request).",
    "data.eval_candidates": "MovieLens ranker: candidates per eval and test request, the "
                            "held-out movie and movies the user never rated (101: the "
                            "SASRec paper's sampled protocol).",
    "data.like_rating": "MovieLens requests: the least rating that is a `liked` action "
                        "(every rating is a `rated` one).",
    "data.actions": "Names of the actions, in label order.",
    # Model
    "model.name": "The model: `dlrm`, `dcn` (DCN-v2; `dcn_v2` too), `ranker`, "
                  "`two_tower`, or the next-item `sasrec` and `hstu`.",
    "model.embed_dim": "Width of every DLRM / DCN-v2 table.",
    "model.embed_init_std": "Your own logs: the standard deviation of the tables' normal initial "
                            "rows (0: the default, variance 1 / `embed_dim`).",
    "model.bottom_sizes": "Widths of the bottom MLP over the dense features.",
    "model.top_sizes": "Widths of the top MLP, ending in 1 (the logit).",
    "model.combiner": "Pooling of a multi-hot bag: `sum`, `mean` or `sqrtn`.",
    "model.cross_layers": "Cross layers of DCN-v2 (`model.name=\"dcn\"`).",
    "model.num_unique": "Distinct ids per data shard a collection's lookup dedups to; "
                        "None turns dedup off, `auto` dedups the tables where the plan "
                        "finds it pays.",
    "model.id_skew": "How much each table's ids repeat, for `auto` dedup's plan: None "
                     "(uniform ids), a Zipf exponent for every table, or `fit`: fitted to "
                     "the first training batch and saved in the workdir (`id_skew.json`), "
                     "which a resume and serving's restore read back.",
    "model.kernel": "The local lookup kernel: `auto`, `xla`, `pallas`, `mosaic`, "
                    "`triton` or `cpu`.",
    "model.replicate_below_bytes": "Tables up to this many bytes are replicated (None: "
                                   "the library default).",
    "model.width": "Width of the transformer's tokens.",
    "model.dropout": "Sequential models: dropout rate of the input rows and each residual "
                     "branch.",
    "model.num_time_buckets": "HSTU: buckets of log time gap in its relative time bias.",
    "model.scale_embeddings": "Sequential models: multiply item rows by sqrt(width).",
    "model.repeat_bias": "Sequential models: learn a logit for the items in the row's input.",
    "model.num_layers": "Transformer layers.",
    "model.num_heads": "Attention heads; `model.width` must divide into them.",
    "model.mlp_ratio": "Width of each transformer MLP, as a multiple of `model.width`.",
    "model.causal": "History events attend to earlier events only (the ranker's "
                    "`:causal`).",
    "model.item_features": "Width of the ranker's item table.",
    "model.author_features": "Width of the author table.",
    "model.action_features": "Width of the multi-hot actions' projection in a history "
                             "token.",
    "model.features": "Width of the two-tower item table and of both towers' outputs.",
    "model.tower_sizes": "Hidden widths of each tower's MLP.",
    "model.user_tower": "`pooled` (the history's events pooled) or `trunk` (the ranker's "
                        "transformer).",
    "model.temperature": "Initial softmax temperature (scores are cosine similarities "
                         "divided by it).",
    "model.min_temperature": "Lowest temperature learning may reach.",
    "model.max_temperature": "Highest temperature learning may reach (at most 1).",
    "model.learn_temperature": "Learn the temperature, or keep it fixed.",
    "model.*_hash.num_buckets": "Rows of a multi-hash table (row 0 pads).",
    "model.*_hash.num_hashes": "Hashes per id (1 to 16, below `num_buckets`).",
    "model.*_hash.features": "Width of each hashed row.",
    "model.*_hash.combiner": "How an id's rows combine: `concat` (then projected) or "
                             "`sum`.",
    "model.*_hash.seed": "Seed of the hash coefficients: the same rows on every host.",
    # Optimizers
    "optim.dense.name": "Optimizer of the dense weights: `adam`, `adagrad` or `sgd` (optax).",
    "optim.sparse.name": "Row-wise optimizer of the tables: `rowwise_adagrad`, "
                         "`lazy_adam` or `sgd`.",
    "optim.*.learning_rate": "Peak learning rate.",
    "optim.*.schedule": "`constant` or `warmup_cosine` (linear warmup, then cosine decay "
                        "to 0 at the last step).",
    "optim.*.warmup_steps": "Steps of linear warmup (`warmup_cosine`).",
}


#: Variants documented beside their config's default: ``{config: (argument, ...)}``;
#: each is a column ``config:argument``.
VARIANTS = {"movielens": ("two_tower", "ranker")}


def config_names() -> list[str]:
  names = sorted(p.stem for p in (ROOT / "configs").glob("*.py")
                 if p.stem not in ("__init__", "parts"))
  return [n for name in names for n in [name] + [f"{name}:{v}" for v in VARIANTS.get(name, ())]]


def _flatten(config, prefix=""):
  for key, value in config.items():
    if hasattr(value, "items"):
      yield from _flatten(value, prefix + key + ".")
    else:
      yield prefix + key, value


def config_values() -> dict[str, dict[str, object]]:
  """key -> {config name: its value in the config's default variant}."""
  if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
  values: dict[str, dict[str, object]] = {}
  for name in config_names():
    module, _, variant = name.partition(":")
    # A variant's argument is MODEL,PATH: the path is left empty.
    config = importlib.import_module(f"configs.{module}").get_config(
        f"{variant}," if variant else None)
    for key, value in _flatten(config):
      values.setdefault(key, {})[name] = value
  return values


def explanations_of(key: str) -> list[str]:
  return [pattern for pattern in EXPLAINED if fnmatch.fnmatchcase(key, pattern)]


def _show(value) -> str:
  if isinstance(value, tuple) and len(value) > 4 and len(set(value)) == 1:
    return f"`({value[0]!r},) * {len(value)}`"
  if isinstance(value, tuple) and all(isinstance(v, str) for v in value):
    return "`" + ", ".join(value) + "`"
  return f"`{value!r}`"


def write_page(path: pathlib.Path) -> list[str]:
  """Writes the table of keys to ``path``; returns the keys without an explanation."""
  values = config_values()
  names = config_names()
  group_of = lambda key: key.split(".")[0] if "." in key else ""
  groups = {"": "The run", "task": "The task", "data": "Data", "model": "Model",
            "optim": "Optimizers"}
  # A group a new config brings gets its key as its title.
  groups.update({g: f"`{g}`" for g in sorted({group_of(k) for k in values}) if g not in groups})
  lines, unexplained = [], []
  for group, title in groups.items():
    keys = sorted(k for k in values if group_of(k) == group)
    if not keys:
      continue
    lines += [f"### {title}", "", "| key | what | " + " | ".join(names) + " |",
              "|---|---|" + "---|" * len(names)]
    for key in keys:
      found = explanations_of(key)
      if len(found) != 1:
        unexplained.append(key)
      what = EXPLAINED[found[0]] if len(found) == 1 else "**not explained**"
      cells = [_show(values[key][n]) if n in values[key] else "" for n in names]
      lines.append(f"| `{key}` | {what} | " + " | ".join(cells) + " |")
    lines.append("")
  path.parent.mkdir(parents=True, exist_ok=True)
  text = "\n".join(lines)
  if not path.exists() or path.read_text() != text:
    path.write_text(text)
  return unexplained
