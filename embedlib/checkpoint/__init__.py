"""Checkpoints that store logical, unpadded tables and slots, shard by shard: restore on any mesh."""

from embedlib.checkpoint.logical import load_state, restore_targets, split_state
from embedlib.checkpoint.manager import (
    CheckpointMismatchError,
    CheckpointRestoreError,
    Checkpointer,
    CheckpointSaveError,
)
from embedlib.checkpoint.sharded import Logical, ShardedArraysHandler

__all__ = [
    "CheckpointMismatchError",
    "CheckpointRestoreError",
    "CheckpointSaveError",
    "Checkpointer",
    "Logical",
    "ShardedArraysHandler",
    "load_state",
    "restore_targets",
    "split_state",
]
