"""Fixtures choosing the update path a test traces: fused CPU call, XLA ops, or sorted.

On CPU ``apply_row_grads`` runs the fused C++ update (``fused_cpu``), or
``apply.py``'s XLA ops where it does not apply; every other platform runs
the sorted update (``sorted_update``). Tests of the rules' results run all
three; tests of the XLA ops' own properties (their dedup paths) pin the
XLA ops.
"""

import pytest

from embedlib.optim import fused_cpu, sorted_update

from ..cpu_kernels import require_cpu_kernels


@pytest.fixture
def xla_update():
  """The test traces ``apply.py``'s XLA ops, the path of every platform but CPU."""
  with fused_cpu.use(False):
    yield


@pytest.fixture(params=["fused", "xla", "sorted"])
def update_path(request):
  """The test runs with the fused CPU update, the XLA ops, and the sorted (GPU) update."""
  if request.param == "fused":
    require_cpu_kernels()
  with fused_cpu.use(request.param == "fused"), sorted_update.use(request.param == "sorted"):
    yield request.param
