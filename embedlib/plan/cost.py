"""The cost model behind the automatic layout choice: memory and traffic.

Estimates, per device, of the table bytes a layout stores and of the bytes a
lookup moves between devices, using ring-collective volumes (an all-gather
or reduce-scatter over ``k`` ranks moves ``(k - 1) / k`` of the full buffer,
an all-reduce twice that). They rank layouts; they are not a timing model.
"""

from __future__ import annotations

import math

from embedlib import options

ID_BYTES = 4  # ids travel as int32


def padded_shape(num_embeddings, features, strategy, group_size):
  """Physical table shape: the sharded dimension rounded up to the group.

  >>> padded_shape(50257, 768, "vocab", 8)
  (50264, 768)
  >>> padded_shape(1000, 100, "hidden", 8)
  (1000, 104)
  """
  if strategy == options.VOCAB:
    return (math.ceil(num_embeddings / group_size) * group_size, features)
  if strategy == options.HIDDEN:
    return (num_embeddings, math.ceil(features / group_size) * group_size)
  return (num_embeddings, features)


def table_bytes_per_device(padded, strategy, group_size, itemsize) -> int:
  """Bytes of the table shard each device stores.

  >>> table_bytes_per_device((1024, 64), "vocab", 8, 4)
  32768
  """
  rows, cols = padded
  if strategy == options.REPLICATED:
    return rows * cols * itemsize
  return rows * cols * itemsize // group_size


def bytes_moved_per_lookup(
    padded, strategy, *, tokens, data_shards, token_ranks, rest_ranks, itemsize
) -> int:
  """Bytes one device receives for one lookup of ``tokens`` ids (global).

  Args:
    padded: physical table shape ``(rows, cols)``.
    strategy: ``"replicated" | "vocab" | "hidden"``.
    tokens: ids per lookup over the whole mesh (the global batch).
    data_shards: devices the tokens are split over.
    token_ranks: table ranks that hold different tokens (the token axes).
    rest_ranks: table ranks that hold the same tokens (ids replicated).
    itemsize: bytes per table element.

  Returns:
    The estimate, in bytes.

  >>> bytes_moved_per_lookup((1000, 64), "hidden", tokens=4096, data_shards=1,
  ...                        token_ranks=1, rest_ranks=8, itemsize=4)
  917504
  """
  if strategy == options.REPLICATED:
    return 0
  cols = padded[1]
  local_tokens = math.ceil(tokens / data_shards)
  group_tokens = local_tokens * token_ranks
  moved = (token_ranks - 1) * local_tokens * ID_BYTES  # ids all-gather
  if strategy == options.VOCAB:
    full = group_tokens * cols * itemsize
    moved += 2 * (rest_ranks - 1) * full // rest_ranks  # psum over rest
    moved += (token_ranks - 1) * full // token_ranks  # psum_scatter
  else:
    width = cols // (token_ranks * rest_ranks)
    moved += (rest_ranks - 1) * group_tokens * width * itemsize  # all-gather
    moved += (token_ranks - 1) * local_tokens * width * itemsize  # all-to-all
  return moved
