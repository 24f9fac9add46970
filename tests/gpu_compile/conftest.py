"""The deviceless GPU compile tier: skipped, with the reason, where the CUDA plugin isn't installed.

Installed by ``pip install -e '.[gpu-compile]'`` (Python >= 3.12, CI's 3.12
leg); the root conftest already sets ``JAX_PLATFORMS=cpu``, which the plugin
needs on a machine without a GPU (``embedlib.kernels.deviceless``).
"""

import pathlib

import pytest

from embedlib.kernels import deviceless

_HERE = pathlib.Path(__file__).parent


def pytest_collection_modifyitems(config, items):
  reason = deviceless.unavailable_reason()
  if reason is None:
    return
  skip = pytest.mark.skip(reason=f"deviceless GPU compiles: {reason}")
  for item in items:
    if _HERE in pathlib.Path(item.fspath).parents:
      item.add_marker(skip)
