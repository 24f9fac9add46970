"""Checkpoints that store logical, unpadded tables and slots: restore on any mesh."""

from embedlib.checkpoint.logical import abstract_like, load_logical_state, logical_state
from embedlib.checkpoint.manager import (
    CheckpointMismatchError,
    CheckpointRestoreError,
    Checkpointer,
    CheckpointSaveError,
)

__all__ = [
    "CheckpointMismatchError",
    "CheckpointRestoreError",
    "CheckpointSaveError",
    "Checkpointer",
    "abstract_like",
    "load_logical_state",
    "logical_state",
]
