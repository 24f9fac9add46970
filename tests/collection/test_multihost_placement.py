"""Routed tables and stacks train alike on 2 processes x 4 devices and on 1 x 8.

``jax.distributed`` on 127.0.0.1 (gloo collectives on CPU): the routes'
all-to-alls and the row gradients' cross the process boundary. Each
process feeds its half of every global batch. Tolerance: 1e-4 relative, as
in ``tests/train/test_multihost.py`` (cross-process reductions add in
another order).
"""

import os
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from tests import xla_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = textwrap.dedent("""
    import sys
    import jax
    if len(sys.argv) > 1:
      jax.distributed.initialize(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
    import jax.numpy as jnp, numpy as np, optax
    from flax import nnx
    from embedlib import EmbeddingCollection, FeatureSpec, TableSpec, optim
    from embedlib.data import to_global_batch

    tables = [TableSpec("big", 3000, 8, sharding="routed"),
              TableSpec("mid", 300, 8, sharding="table_row"),
              TableSpec("a", 50, 8, sharding="table"), TableSpec("b", 40, 8, sharding="table"),
              TableSpec("rows", 2000, 16, sharding="routed"),
              TableSpec("v", 500, 16, sharding="vocab")]
    features = [FeatureSpec("f_big", "big", combiner="mean"),
                FeatureSpec("f_mid", "mid", combiner=None, max_ids_per_sample=2),
                FeatureSpec("f_a", "a", max_ids_per_sample=1), FeatureSpec("f_b", "b"),
                FeatureSpec("f_rows", "rows"), FeatureSpec("f_v", "v")]
    mesh = jax.make_mesh((8,), ("batch",), axis_types=(jax.sharding.AxisType.Auto,))

    class Model(nnx.Module):
      def __init__(self, rngs):
        self.embeddings = EmbeddingCollection(
            tables[:4], features[:4], mesh=mesh, table_batched=True, devices_per_host=4,
            batch_size=32, rngs=rngs)
        self.more = EmbeddingCollection(tables[4:], features[4:], mesh=mesh, batch_size=32,
                                        rngs=rngs)
        self.head = nnx.Linear(8 + 16 + 8 + 8 + 16 + 16, 1, rngs=rngs)
      def __call__(self, x):
        out = {**self.embeddings({k: x[k] for k in ("f_big", "f_mid", "f_a", "f_b")}),
               **self.more({k: x[k] for k in ("f_rows", "f_v")})}
        flat = [out[f.name].reshape(out[f.name].shape[0], -1) for f in features]
        return self.head(jnp.concatenate(flat, axis=-1))[:, 0]

    model = Model(nnx.Rngs(0))
    opt = optim.SparseAwareOptimizer(model, optax.sgd(0.1), optim.RowWiseAdagrad(0.3))

    @nnx.jit
    def step(model, opt, x, y):
      loss, grads = optim.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
      opt.update(model, grads)
      return loss

    half = slice(jax.process_index() * 32 // jax.process_count(),
                 (jax.process_index() + 1) * 32 // jax.process_count())
    for k in range(3):
      rng = np.random.default_rng(k)
      x = {"f_big": rng.integers(-1, 3000, (32, 3)), "f_mid": rng.integers(0, 300, (32, 2)),
           "f_a": rng.integers(0, 50, (32,)), "f_b": rng.integers(-1, 40, (32, 2)),
           "f_rows": rng.integers(-1, 2000, (32, 4)), "f_v": rng.integers(0, 500, (32, 2))}
      y = rng.normal(size=32).astype(np.float32)
      x, y = to_global_batch(({k: v[half].astype(np.int32) for k, v in x.items()}, y[half]), mesh)
      loss = float(step(model, opt, x, y))
      sums = [float(jnp.sum(jnp.abs(model.embeddings.logical_table(n)))) for n in ("big", "mid", "a", "b")]
      sums.append(float(jnp.sum(jnp.abs(model.more.logical_table("rows")))))
      if jax.process_index() == 0:
        print("step", k, loss, *sums, flush=True)
""")


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _env(devices):
  return xla_env.subprocess_env(devices)


def _steps(stdout):
  return np.array([[float(v) for v in line.split()[2:]] for line in stdout.splitlines()
                   if line.startswith("step")])


@pytest.mark.slow
def test_two_processes_match_one():
  single = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=_env(8),
                          capture_output=True, text=True, timeout=600)
  assert single.returncode == 0, single.stderr[-3000:]
  port = _free_port()
  procs = [subprocess.Popen([sys.executable, "-c", SCRIPT, f"127.0.0.1:{port}", "2", str(i)],
                            cwd=ROOT, env=_env(4), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True) for i in range(2)]
  outputs = [p.communicate(timeout=600) for p in procs]
  for p, (_, err) in zip(procs, outputs):
    assert p.returncode == 0, err[-3000:]
  one, two = _steps(single.stdout), _steps(outputs[0][0])
  assert one.shape == two.shape == (3, 6)
  assert one[2, 0] != one[0, 0]  # the model trained
  np.testing.assert_allclose(two, one, rtol=1e-4)
