"""The values of embedlib's string options, in one place.

Plans, modules and tests compare against these names rather than string
literals.
"""

#: Layouts a table can have (``sharding=``); ``AUTO`` lets the planner choose.
REPLICATED = "replicated"
VOCAB = "vocab"
HIDDEN = "hidden"
STRATEGIES = (REPLICATED, VOCAB, HIDDEN)
AUTO = "auto"

#: Pooling combiners for multi-hot features (``combiner=``).
COMBINERS = ("sum", "mean", "sqrtn")

#: Local lookup kernels (``kernel=``).
KERNELS = ("auto", "xla", "pallas", "mosaic", "triton", "cpu")
