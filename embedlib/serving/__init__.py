"""Serving an exported model with jax and numpy alone.

``load(directory)`` reads an artifact written by ``python -m train.export``
(``artifact``: a manifest, a ``jax.export`` program, ``.npy`` weights) and
returns a ``ServedModel``, called with a dict of named numpy or jax inputs.
Importing this package imports neither flax nor embedlib's model code.
"""

from embedlib.serving.artifact import ArtifactError
from embedlib.serving.model import InputError, PlatformError, ServedModel, load

__all__ = ["ArtifactError", "InputError", "PlatformError", "ServedModel", "load"]
