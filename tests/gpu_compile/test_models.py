"""The train steps of the configs' models compile for 8 H200s, small in CI and at their documented sizes.

DLRM (``configs/dlrm_criteo.py``), the transformer ranker
(``configs/ranker.py``), two-tower retrieval (``configs/two_tower.py``) and
the sequential MovieLens model (``configs/movielens.py``, SASRec, its item
table sized from a tiny ML-100K-format file), each built as ``train``
builds it (``train_steps``) and checked: the lookups and sparse updates are
XLA's ops (``kernel="auto"`` on a GPU: measured faster than the Mosaic
kernels, which ``test_strategies`` and ``test_sparse_step`` compile), no CPU
custom call, no spills, collectives asynchronous, the state updated in place.

A step's compile time follows its number of kernels (a few hundred fusions,
each through LLVM and ptxas), which the smoke variants share with the
documented sizes; so CI compiles DLRM's and SASRec's ``:smoke`` variants (the
same code paths; their dense layers' GEMMs by cuBLAS, `SMOKE_OPTIONS`), and
``-m slow`` the ranker's and two towers' too, and the four at their documented sizes (XLA's Triton GEMMs
and its default autotuning, `DOCUMENTED_OPTIONS`), checked within one
H200's HBM. Figures: ``benchmarks/README.md`` ("Compiled for H100 / H200").
"""

import importlib

import pytest

from tests.gpu_compile import compiled, train_steps

# config module, collectives its step must hold
MODELS = {
    "dlrm": ("configs.dlrm_criteo", ("all-gather",)),
    "ranker": ("configs.ranker", ("all-gather",)),
    "two_tower": ("configs.two_tower", ("all-gather",)),
    "movielens": ("configs.movielens", ("all-reduce",)),
}

# XLA's own kernels known to spill registers, and where.
KNOWN_XLA_SPILLS = {
    "dlrm": ("XLA fuses the dot interaction's backward for the 26 features into one "
             "multi-output loop fusion (loop_gather_select_fusion, 73 operands), whose "
             "kernel spills 8 bytes"),
}
# The smoke compiles: the dense layers' GEMMs by cuBLAS (a custom call, nothing
# to compile) rather than XLA's Triton GEMM fusions, each a Triton, LLVM and
# ptxas compile of its own: XLA's kernels, not embedlib's, which the
# documented sizes compile. They fail on any spill: DLRM's spilling fusion
# spills at the documented width only.
SMOKE_OPTIONS = {"xla_gpu_enable_triton_gemm": False}
# The documented sizes: XLA's own settings, its default autotuning level (4)
# included, which `compiled.CHECK_OPTIONS` turns off for the other compiles.
DOCUMENTED_OPTIONS = {"xla_gpu_autotune_level": 4}


def config_of(name, variant, tmp_path_factory):
  module = MODELS[name][0]
  config = importlib.import_module(module).get_config(variant)
  if name == "movielens":
    from tests.train.test_sequential import write_ml100k  # pylint: disable=g-import-not-at-top

    # ML-100K's users and items at the documented size; a tiny file for smoke.
    size = dict(num_users=943, num_items=1682) if variant is None else {}
    config.data.path = str(write_ml100k(tmp_path_factory.mktemp(name) / "ml-100k", **size))
  return config


def compile_step(name, config, **kwargs):
  mesh = train_steps.mesh_for(config, "H200")
  step, state, batch = train_steps.train_step(config, mesh)
  return compiled.compile_checked(name, step, state, batch, mesh=mesh, target="H200",
                                  donate_argnums=0, **kwargs)


# CI compiles DLRM's and SASRec's; the ranker's and two towers' step add
# dense layers XLA compiles as any model's, and their lookups and updates
# are DLRM's: -m slow.
@pytest.fixture(scope="module", params=[
    n if n in ("dlrm", "movielens") else pytest.param(n, marks=pytest.mark.slow) for n in MODELS])
def smoke(request, tmp_path_factory):
  name = request.param
  return name, compile_step(name, config_of(name, "smoke", tmp_path_factory),
                            options=SMOKE_OPTIONS)


@pytest.fixture(scope="module", params=[pytest.param(n, marks=pytest.mark.slow) for n in MODELS])
def documented(request, tmp_path_factory):
  name = request.param
  return name, compile_step(name, config_of(name, None, tmp_path_factory),
                            known_xla_spills=name in KNOWN_XLA_SPILLS, options=DOCUMENTED_OPTIONS)


def check_step(name, program):
  """The step's custom calls, spills and collectives, and its state updated in place.

  The configs' ``kernel="auto"`` runs XLA's lookups on a GPU and the sorted
  update in XLA ops (both measured faster than the Mosaic kernels on an
  H200, ``embedlib/kernels/gpu_choice.py``): no Mosaic kernel is in the step.
  """
  compiled.check_all(program, kernels=(), collectives_=MODELS[name][1])
  assert not program.mosaic_kernels, (name, program.mosaic_kernels)
  memory = program.memory
  # Beyond the donated state: the loss and the logged scalars.
  assert memory.output_size_in_bytes - memory.alias_size_in_bytes <= 4096


def test_smoke_train_step_compiles_with_gpu_kernels_in_place(smoke):
  check_step(*smoke)


def test_train_step_compiles_with_gpu_kernels_and_async_collectives(documented):
  name, program = documented
  check_step(name, program)
  if program.xla_spills:
    pytest.xfail(KNOWN_XLA_SPILLS[name])


def test_train_step_fits_one_h200(documented):
  _, program = documented
  compiled.assert_fits(program)
