"""TorchRec managed-collision training-step worker for ``benchmarks/dynamic_lookup.py`` (runs in ``.peers``).

    .peers/bin/python benchmarks/peers/torchrec_mch.py --data BATCHES.npz \
        --rows 1048576 --width 64 [--variant mch|fixed] [--threads 2] [--stats OUT.json]

Started by ``dynamic_lookup.py``, which sends it ``run`` requests (see
``worker_protocol.py``); not meant to be run by hand. The batches are the
JAX side's raw ids (``ids [steps, n]`` int64: the uint64 values' bit
patterns), taken in the same order: ``--warmup`` steps first, then one new
batch per step. The loss is the JAX side's, ``mean(sum(rows, -1) ** 2)``.

Variants:

- ``mch``: ``torchrec.modules.mc_modules.ManagedCollisionCollection`` with
  one ``MCHManagedCollisionModule`` (``zch_size = rows``,
  ``LRU_EvictionPolicy``, ``eviction_interval=1``: every step admits its new
  ids before the lookup, evicting the least recently used, as the JAX
  table's LRU with ``admit_after=1``) in front of a
  ``FusedEmbeddingBagCollection`` with FBGEMM's fused
  ``EXACT_ROWWISE_ADAGRAD`` (one id per bag). An id the module does not hold
  reads its last row (``zch_size - 1``), shared by all such ids. TorchRec's
  unsharded ``evict`` hook is a no-op (``mc_embedding_modules.evict``), so
  an evicted row keeps its values and optimizer state;
- ``fixed``: the same fused table with the ids hashed mod ``rows`` (the JAX
  side's fixed table).

With ``--stats``, after the last request the worker writes, for each step's
batch, the number of rows read by two or more distinct raw ids, the
distinct ids on such rows, and the share of lookups that read the miss row
(computed from the remapped ids kept during the steps, outside the timed
requests' work).
"""

import argparse
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from worker_protocol import serve  # noqa: E402


def build(variant, rows, width, lr):
  import torchrec
  from torchrec.modules.embedding_configs import EmbeddingBagConfig
  from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
  from torchrec.modules.mc_modules import (LRU_EvictionPolicy, ManagedCollisionCollection,
                                           MCHManagedCollisionModule)

  config = EmbeddingBagConfig(name="t", embedding_dim=width, num_embeddings=rows,
                              feature_names=["f"])
  tables = FusedEmbeddingBagCollection(
      tables=[config], optimizer_type=torchrec.optim.RowWiseAdagrad,
      optimizer_kwargs={"lr": lr, "eps": 1e-8}, device=torch.device("cpu"))
  if variant == "fixed":
    return tables, None
  mch = MCHManagedCollisionModule(
      zch_size=rows, device=torch.device("cpu"), eviction_policy=LRU_EvictionPolicy(),
      eviction_interval=1, name="t")
  mcc = ManagedCollisionCollection({"t": mch}, [config])
  mcc.train()
  return tables, mcc


def shared_rows(raw: np.ndarray, rows: np.ndarray) -> dict:
  """Rows read by >= 2 distinct raw ids in one batch, and the distinct ids on them."""
  pairs = np.unique(np.stack([rows, raw]), axis=1)          # distinct (row, id)
  row_of_pair = pairs[0]
  uniq_rows, per_row = np.unique(row_of_pair, return_counts=True)
  shared = per_row >= 2
  return {"shared_rows": int(shared.sum()), "ids_on_shared_rows": int(per_row[shared].sum()),
          "distinct_ids": int(pairs.shape[1]), "rows_read": int(len(uniq_rows))}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--data", required=True)
  parser.add_argument("--rows", type=int, required=True)
  parser.add_argument("--width", type=int, required=True)
  parser.add_argument("--variant", choices=("mch", "fixed"), default="mch")
  parser.add_argument("--threads", type=int, default=2)
  parser.add_argument("--lr", type=float, default=0.01)
  parser.add_argument("--warmup", type=int, default=4)
  parser.add_argument("--stats", default=None)
  args = parser.parse_args()

  from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

  torch.set_num_threads(args.threads)
  torch.manual_seed(0)
  batches = np.load(args.data)["ids"]
  tables, mcc = build(args.variant, args.rows, args.width, args.lr)
  n = batches.shape[1]
  lengths = torch.ones(n, dtype=torch.int32)
  kjts = []
  for b in batches:
    values = b if mcc is not None else (b.view(np.uint64) % np.uint64(args.rows)).astype(np.int64)
    kjts.append(KeyedJaggedTensor.from_lengths_sync(
        keys=["f"], values=torch.from_numpy(np.ascontiguousarray(values)), lengths=lengths))
  seen = []     # (batch index, remapped ids) per step, for --stats
  state = {"next": 0}

  def step():
    i = state["next"] % len(kjts)
    state["next"] += 1
    kjt = kjts[i]
    if mcc is not None:
      kjt = mcc(kjt)
      seen.append((i, kjt.values()))
    loss = torch.mean(torch.sum(tables(kjt)["f"], dim=-1) ** 2)
    loss.backward()   # FBGEMM updates the touched rows here
    return loss

  def run_steps(k):
    loss = None
    for _ in range(k):
      loss = step()
    return loss.item()

  first = run_steps(args.warmup)
  serve(run_steps, {"variant": args.variant, "torch": torch.__version__,
                    "threads": torch.get_num_threads(),
                    "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(unset)"),
                    "first_loss": first})
  if args.stats and mcc is not None:
    out = [dict(shared_rows(batches[i], r.numpy()), batch=int(i),
                miss_share=float((r == args.rows - 1).float().mean()))
           for i, r in seen[args.warmup:]]
    with open(args.stats, "w") as f:
      json.dump(out, f)


if __name__ == "__main__":
  main()
