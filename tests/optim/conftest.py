"""Fixtures choosing the update path a test traces: the fused CPU call or XLA ops.

On CPU ``apply_row_grads`` runs the fused C++ update (``fused_cpu``); every
other platform runs ``apply.py``'s XLA ops. Tests of the rules' results run
both; tests of the XLA ops' own properties (their dedup paths) pin the XLA
ops.
"""

import pytest

from embedlib.optim import fused_cpu

from ..cpu_kernels import require_cpu_kernels


@pytest.fixture
def xla_update():
  """The test traces ``apply.py``'s XLA ops, the path of every platform but CPU."""
  with fused_cpu.use(False):
    yield


@pytest.fixture(params=["fused", "xla"])
def update_path(request):
  """The test runs once with the fused CPU update and once with the XLA ops."""
  if request.param == "fused":
    require_cpu_kernels()
  with fused_cpu.use(request.param == "fused"):
    yield request.param
