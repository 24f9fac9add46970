"""The training loop behind ``python -m train``, importable from tests and notebooks.

``train_and_evaluate(config, workdir)`` turns a ``configs/*.py`` config into a
task (``tasks``: its data, model, loss and metrics), a mesh and an optimizer
(``setup``), reads the loop's keys once (``Loop``), trains, evaluates and checkpoints in ``workdir`` (metrics
through ``writers``), and resumes from the workdir's newest checkpoint.
"""

from embedlib.training.loop import Loop
from embedlib.training.pipeline import (
    LookaheadError,
    Pipeline,
    distribute_batch,
    pipelined_train_step,
)
from embedlib.training.setup import ConfigError
from embedlib.training.steps import eval_step, train_step
from embedlib.training.tasks import Task, make_task
from embedlib.training.train_lib import evaluate, oracle_gap, train_and_evaluate
from embedlib.training.writers import MetricWriteError, MetricWriter, read_jsonl

__all__ = [
    "ConfigError",
    "LookaheadError",
    "Loop",
    "MetricWriteError",
    "MetricWriter",
    "Pipeline",
    "Task",
    "distribute_batch",
    "eval_step",
    "evaluate",
    "make_task",
    "oracle_gap",
    "pipelined_train_step",
    "read_jsonl",
    "train_and_evaluate",
    "train_step",
]
