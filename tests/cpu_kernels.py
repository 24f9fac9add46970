"""For tests of the CPU kernels (``embedlib/kernels/cpu_library.py``)."""

import pytest

from embedlib.kernels import cpu_library


def require_cpu_kernels():
  """Skips without a C++ compiler; with one, a library that does not build fails the test."""
  if cpu_library.compiler() is None:
    pytest.skip("no C++ compiler (CXX, c++, g++, clang++): the CPU kernels are off")
  assert cpu_library.library() is not None, "the CPU kernels did not build; see the warning logged"
