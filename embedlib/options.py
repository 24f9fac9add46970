"""The values of embedlib's string options, in one place.

Plans, modules and tests compare against these names rather than string
literals.
"""

#: Layouts a table can have (``sharding=``); ``AUTO`` lets the planner choose.
REPLICATED = "replicated"
VOCAB = "vocab"
HIDDEN = "hidden"
#: Rows split like ``VOCAB``; each id is sent to the rank owning its row and
#: the row comes back (all-to-all at a static capacity per destination).
ROUTED = "routed"
#: Rows split like ``VOCAB`` over ``table_axes`` and columns like ``HIDDEN``
#: over ``column_axes`` at once (FSDP x tensor parallel: ``P('tensor', 'fsdp')``).
GRID = "grid"
STRATEGIES = (REPLICATED, VOCAB, HIDDEN, ROUTED, GRID)
#: Layouts that split the table by rows (the same physical table and slots).
ROW_SHARDED = (VOCAB, ROUTED)
#: Layouts whose rows are split into blocks over ``table_axes`` (a rank owns
#: a block of rows: the vocab-parallel logits and loss apply).
ROW_BLOCKS = (VOCAB, ROUTED, GRID)
#: Layouts whose ranks hold a slice of each row's columns (a row's update
#: needs its whole gradient on every rank of the slice's group).
COLUMN_SPLIT = (HIDDEN, GRID)
#: Collection placements: a table whole on one device, or split over the
#: devices of one host, inside a stack of tables of its width (routed).
TABLE_WISE = "table"
TABLE_ROW_WISE = "table_row"
PLACEMENTS = (TABLE_WISE, TABLE_ROW_WISE)
AUTO = "auto"

#: Pooling combiners for multi-hot features (``combiner=``).
COMBINERS = ("sum", "mean", "sqrtn")

#: Local lookup kernels (``kernel=``).
KERNELS = ("auto", "xla", "pallas", "mosaic", "triton", "cpu")

#: What a step does when a static capacity (``num_unique``, a route's
#: ``route_capacity``) is too small: look it up another way, or raise.
FALLBACK = "fallback"
ERROR = "error"
ON_OVERFLOW = (FALLBACK, ERROR)

#: Values of an environment switch (``EMBEDLIB_CPU_KERNELS``,
#: ``EMBEDLIB_KEEP_FREED_BLOCKS``, ``EMBEDLIB_HUGE_PAGES``, read by the CPU
#: kernels' ``cpu/huge_pages.h``) that turn it off, in any case.
SWITCHED_OFF = ("0", "false", "off", "no")


def switched_off(value: str) -> bool:
  """Whether an environment switch's value turns it off.

  >>> switched_off(" Off"), switched_off("1"), switched_off("")
  (True, False, False)
  """
  return value.strip().lower() in SWITCHED_OFF
