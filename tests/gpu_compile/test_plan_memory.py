"""The plan's memory of the embedding's step against the compiled step, on 8 H200s.

``embedding_steps.embedding_step`` compiles a config's lookups and sparse
step alone, as ``train`` builds them (``kernel="auto"``: XLA's lookups and
the sorted update's XLA ops on a GPU); XLA's memory analysis of it
(arguments, outputs not aliased to them, temporaries) is what
``embedlib.plan.memory.device_memory`` states for its tables. The tables,
slots and ids are exact (the arguments, to the optimizer's 4-byte step
count); the temporaries' three constants (``SMALL_BUFFERS``,
``KEPT_ENTRIES``, ``LOOKUP_ID_WORDS``) were calibrated on these compiles
when ``auto`` ran the Mosaic kernels and the fused update.

At the documented sizes the plan is within 5% of the default step
(quickstart +3.9%, dlrm_criteo +0.0%, ranker -4.2%, two_tower +2.4%). At
the smoke sizes the temporaries are most of the step (a few hundred small
buffers, each aligned by XLA's allocator), and the XLA path holds fewer of
them than the kernels' step the constants were fitted to: the plan states
14% to 23% more, the safe side for choosing a layout, and no refit of the
three constants brings every program within 5% (the best leaves 5.3%;
``benchmarks/README.md``). So the smoke checks hold the plan to at least
the compiled total and at most 25% over it: still failing a plan that
drops the small buffers (48% to 73% of each smoke total) or a routed
step's exchange. CI compiles quickstart's smoke variant (routed tables and
a multi-hot bag: the exchange buffers and the small ones); ``-m slow``
adds quickstart at its documented size (the 5% check) and the other
three configs at both sizes. Figures for every config:
``benchmarks/gpu_plan.py --only memory``.
"""

import importlib

import pytest

from embedlib.plan import memory
from tests.gpu_compile import compiled, embedding_steps, train_steps

#: The plan's stated total against the compiled one, as a fraction, at the documented sizes.
TOLERANCE = 0.05
#: At the smoke sizes: the plan at least the compiled total, at most this much over it.
SMOKE_OVER = 0.25
# Memory only: a kernel that spills (the documented DLRM's does, as
# test_models says) is compiled, not failed.
OPTIONS = {"xla_gpu_fail_ptx_compilation_on_register_spilling": False}

# CI compiles quickstart:smoke: the plan's terms for routed tables and a
# multi-hot bag, against a compiled step. -m slow adds the documented sizes
# (the tighter check, on the same terms) and the vocab tables of the rest.
CONFIGS = [pytest.param("quickstart", None, marks=pytest.mark.slow), ("quickstart", "smoke")] + [
    pytest.param(name, variant, marks=pytest.mark.slow)
    for name in ("dlrm_criteo", "ranker", "two_tower") for variant in (None, "smoke")]


def plan_and_compiled(name, variant):
  config = importlib.import_module(f"configs.{name}").get_config(variant)
  mesh = train_steps.mesh_for(config, "H200")
  step, state, inputs, plans = embedding_steps.embedding_step(config, mesh)
  program = compiled.compile_checked(f"{name}:{variant} embedding", step, state, inputs,
                                     mesh=mesh, target="H200", donate_argnums=0,
                                     options=OPTIONS)
  return memory.device_memory(plans, config.optim.sparse.name), program.memory


@pytest.mark.parametrize("name,variant", CONFIGS)
def test_the_plan_states_the_compiled_embedding_step(name, variant):
  planned, compiled_memory = plan_and_compiled(name, variant)
  # Arguments: the tables, slots and ids, exact but for the optimizer's step count.
  arguments = planned.table + planned.slots + planned.ids
  assert 0 <= compiled_memory.argument_size_in_bytes - arguments <= 8, (
      compiled_memory.argument_size_in_bytes, arguments)
  total = compiled.total_bytes(compiled_memory)
  ratio = planned.total / total - 1
  allowed = (0, SMOKE_OVER) if variant == "smoke" else (-TOLERANCE, TOLERANCE)
  assert allowed[0] <= ratio <= allowed[1], (
      f"{name}:{variant}: planned {planned.total} bytes a device, compiled {total} "
      f"(arguments {compiled_memory.argument_size_in_bytes}, temporaries "
      f"{compiled_memory.temp_size_in_bytes}); planned temporaries {planned.temporary}")
