"""PyTorch sparse training-step worker for ``benchmarks/sparse_step.py`` (runs in ``.peers``).

    .peers/bin/python benchmarks/peers/torch_sparse_step.py --data IDS.npz \
        --rows 1000000 --width 64 [--variant fused|sparse|dense] [--threads 2]

Started by ``sparse_step.py``, which sends it ``run`` requests (see
``worker_protocol.py``); not meant to be run by hand. One table, the
batches of ids of the JAX side (``ids [batches, n]`` int32 in the ``.npz``,
or ``[n]``: one batch), step k on batch ``k % batches`` as the JAX cases,
and the same loss, ``mean(sum(table[ids], -1) ** 2)``, one step per request.

Variants:

- ``fused``: TorchRec's ``FusedEmbeddingBagCollection`` (one table, one
  feature, a bag of one id per sample) with FBGEMM's fused
  ``EXACT_ROWWISE_ADAGRAD``: the rows are updated inside the backward pass,
  the same rule as ``embedlib.optim.RowWiseAdagrad`` (``eps=1e-8``);
- ``sparse``: ``nn.Embedding(sparse=True)`` and ``torch.optim.Adagrad``,
  which takes the sparse gradient (element-wise AdaGrad on the touched
  rows: PyTorch's plain sparse path);
- ``dense``: ``nn.Embedding`` and ``torch.optim.Adagrad`` on its dense,
  table-sized gradient (PyTorch's counterpart of the JAX dense step).

Every table starts from the JAX side's values (``initial_table``: a hash
of each entry's position, exact in float32 on both sides), so a variant
with the JAX sparse step's rule (``fused``) must end at its loss; the
Adagrad variants differ (element-wise, accumulators from 0, ``eps=1e-10``).
"""

import argparse
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from worker_protocol import cycle, serve  # noqa: E402


def initial_table(rows, width, out):
  """Fills ``out`` ``[rows, width]`` as ``sparse_step.initial_table`` does (in row blocks)."""
  block = max(1, (1 << 22) // width)
  cols = torch.arange(width, dtype=torch.int64)
  with torch.no_grad():
    for start in range(0, rows, block):
      r = torch.arange(start, min(rows, start + block), dtype=torch.int64)[:, None]
      h = ((r * width + cols) * 2654435761) & 0xFFFFFFFF
      out[start:start + r.shape[0]] = (h >> 16).to(torch.float32) * 2.0**-20 - 2.0**-5


def build_fused(rows, width, batches, lr):
  import torchrec
  from torchrec.modules.embedding_configs import EmbeddingBagConfig
  from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
  from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

  tables = FusedEmbeddingBagCollection(
      tables=[EmbeddingBagConfig(name="t", embedding_dim=width, num_embeddings=rows,
                                 feature_names=["f"])],
      optimizer_type=torchrec.optim.RowWiseAdagrad,
      optimizer_kwargs={"lr": lr, "eps": 1e-8},
      device=torch.device("cpu"))
  (weight,) = [w for w in tables.state_dict().values()]  # FBGEMM's storage, not a copy
  initial_table(rows, width, weight)
  # Built before any step, so that no step times their construction.
  kjts = cycle([KeyedJaggedTensor.from_lengths_sync(
      keys=["f"], values=torch.from_numpy(ids.astype(np.int64)),
      lengths=torch.ones(len(ids), dtype=torch.int32)) for ids in batches])

  def step():
    loss = torch.mean(torch.sum(tables(kjts())["f"], dim=-1) ** 2)
    loss.backward()   # FBGEMM updates the touched rows here
    return loss

  return step, {"torchrec": torchrec.__version__}


def build_plain(rows, width, batches, lr, sparse):
  table = torch.nn.Embedding(rows, width, sparse=sparse)
  initial_table(rows, width, table.weight)
  opt = torch.optim.Adagrad(table.parameters(), lr=lr)
  indices = cycle([torch.from_numpy(ids.astype(np.int64)) for ids in batches])

  def step():
    opt.zero_grad(set_to_none=True)
    loss = torch.mean(torch.sum(table(indices()), dim=-1) ** 2)
    loss.backward()
    opt.step()
    return loss

  return step, {}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--data", required=True)
  parser.add_argument("--rows", type=int, required=True)
  parser.add_argument("--width", type=int, required=True)
  parser.add_argument("--variant", choices=("fused", "sparse", "dense"), default="fused")
  parser.add_argument("--threads", type=int, default=2)
  parser.add_argument("--lr", type=float, default=0.01)
  parser.add_argument("--warmup", type=int, default=2)
  args = parser.parse_args()

  torch.set_num_threads(args.threads)
  torch.manual_seed(0)
  batches = np.atleast_2d(np.load(args.data)["ids"])
  if args.variant == "fused":
    step, info = build_fused(args.rows, args.width, batches, args.lr)
  else:
    step, info = build_plain(args.rows, args.width, batches, args.lr, args.variant == "sparse")
  info["batches"] = len(batches)

  def run_steps(n):
    loss = None
    for _ in range(n):
      loss = step()
    return loss.item()

  first = run_steps(args.warmup)
  serve(run_steps, dict(info, torch=torch.__version__, threads=torch.get_num_threads(),
                        omp_wait_policy=os.environ.get("OMP_WAIT_POLICY", "(unset)"),
                        first_loss=first))


if __name__ == "__main__":
  main()
