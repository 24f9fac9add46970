"""Tasks: what ``train_and_evaluate`` trains (``config.task.name``).

- ``ctr``: one click label per example (DLRM, DCN-v2): AUC, log-loss.
- ``ranking``: several actions per candidate of a request (the transformer
  ranker): per-action AUC, NDCG@K.
- ``retrieval``: one engaged item per request, in-batch softmax (two towers):
  recall@K over a held-out corpus.
- ``sequential``: the next item of a user's history (SASRec, HSTU), softmax
  over every item through the tied table: HR / NDCG / MRR@K by full ranking.
- ``tabular``: a team's own files (Parquet, CSV, RecBole) through their
  schema: DLRM, DCN-v2, the ranker (AUC, log-loss) or two towers (recall@K).

See ``base.Task`` for what a task provides.
"""

from __future__ import annotations

from embedlib.training.tasks.base import ConfigError, Task
from embedlib.training.tasks.ctr import CTRTask
from embedlib.training.tasks.ranking import RankingTask
from embedlib.training.tasks.retrieval import RetrievalTask
from embedlib.training.tasks.sequential import SequentialTask
from embedlib.training.tasks.tabular import TabularTask

_TASKS = {cls.name: cls for cls in (CTRTask, RankingTask, RetrievalTask, SequentialTask,
                                     TabularTask)}


def task_name(config) -> str:
  """``config.task.name``; a config without a ``task`` entry is a ``ctr`` config."""
  return config.task.name if "task" in config else CTRTask.name


def make_task(config) -> Task:
  """The task ``config`` names, built from its settings (once per run: pass it along).

  Its data files are not looked at (``Task.check_data``: ``setup.task``, the
  training loop's, runs both), so a model builds from a config naming none.

  Raises:
    ConfigError: the name is not a task, or its settings can't work.
  """
  name = task_name(config)
  if name not in _TASKS:
    raise ConfigError(f"config.task.name: {name!r}; use one of {tuple(_TASKS)}.")
  return _TASKS[name].from_config(config)


__all__ = ["ConfigError", "CTRTask", "RankingTask", "RetrievalTask", "SequentialTask", "TabularTask", "Task",
           "make_task", "task_name"]
