"""The training loop behind ``python -m train``, importable from tests and notebooks.

``train_and_evaluate(config, workdir)`` turns a ``configs/*.py`` config into a
mesh, data sources, a model and its optimizer (``setup``), trains, evaluates
and checkpoints in ``workdir`` (metrics through ``writers``), and resumes
from the workdir's newest checkpoint.
"""

from embedlib.training.setup import ConfigError
from embedlib.training.train_lib import eval_step, evaluate, oracle_gap, train_and_evaluate, train_step
from embedlib.training.writers import MetricWriteError, MetricWriter, read_jsonl

__all__ = [
    "ConfigError",
    "MetricWriteError",
    "MetricWriter",
    "eval_step",
    "evaluate",
    "oracle_gap",
    "read_jsonl",
    "train_and_evaluate",
    "train_step",
]
