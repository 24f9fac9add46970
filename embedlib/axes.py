"""Mesh axis names, in one place.

Call sites import these constants instead of spelling axis names as string
literals, so that renaming an axis is a one-line change.
"""

#: Conventional names of data-parallel mesh axes. A mesh axis with one of
#: these names is taken as a data axis (the ids' batch dimension is split over
#: it) when ``data_axes`` is not given.
DATA_AXIS_NAMES = ("data", "batch", "replica", "dp", "fsdp", "pod")


def named_data_axes(axis_names) -> tuple[str, ...]:
  """The axes of ``axis_names`` with a data-parallel name (``DATA_AXIS_NAMES``), in order.

  >>> named_data_axes(("data", "model"))
  ('data',)
  """
  return tuple(a for a in axis_names if a in DATA_AXIS_NAMES)

#: Axis names used by the examples, demos and tests.
DATA = "data"
MODEL = "model"
BATCH = "batch"
REPLICA = "replica"
#: The FSDP x tensor-parallel mesh of LLM training (flax's Gemma example):
#: ``P(TENSOR, FSDP)`` asks for a grid-sharded table.
FSDP = "fsdp"
TENSOR = "tensor"
