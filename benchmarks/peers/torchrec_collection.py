"""TorchRec / FBGEMM pooled-lookup worker for ``benchmarks/collection_lookup.py`` (runs in ``.peers``).

    .peers/bin/python benchmarks/peers/torchrec_collection.py --data IDS.npz \
        [--variant ebc|fbgemm] [--threads 2] [--check OUT.npz]

Started by ``collection_lookup.py``, which sends it ``run`` requests (see
``worker_protocol.py``); not meant to be run by hand. Reads from the ``.npz``
the feature names (``names``), each table's weights (``w_<name>``, the JAX
collection's own values), how many batches of ids (``batches``; 1 if
absent) and each feature's padded ids (``ids_<name>``, ``[batches, B]``
single-hot or ``[batches, B, bag]`` with -1 padding, a leading batch axis
only where ``batches`` is given: exactly what the JAX side looks up), and
builds, before any timing, for every batch:

- ``ebc``: ``torchrec.EmbeddingBagCollection`` (one ``nn.EmbeddingBag`` per
  table, ``PoolingType.SUM``) fed a ``KeyedJaggedTensor`` whose lengths are
  the bags' valid ids (-1 padding removed, order kept);
- ``fbgemm``: FBGEMM's table-batched kernel
  (``SplitTableBatchedEmbeddingBagsCodegen``, every table on the host, CPU
  compute, ``PoolingMode.SUM``): one op for all 26 tables, fed the same
  values with per-bag offsets.

A step is one forward under ``torch.no_grad()`` (FBGEMM's CPU kernel fails
under ``torch.inference_mode()``), each on the next batch, from the first
again after the last. With ``--check`` the pooled outputs of the first
batch's forward are written to that ``.npz`` (``out_<name>``, ``[B,
width]``) before the worker reports ready, for the benchmark to compare
with JAX's.
"""

import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from worker_protocol import cycle, serve  # noqa: E402


def jagged(padded: np.ndarray):
  """Padded ``[B]`` / ``[B, bag]`` ids -> (values int64, lengths int64), -1 removed."""
  x = padded.reshape(padded.shape[0], -1)
  valid = x >= 0
  return x[valid].astype(np.int64), valid.sum(1).astype(np.int64)


def build_ebc(names, weights, batches):
  import torchrec  # noqa: PLC0415

  configs = [
      torchrec.EmbeddingBagConfig(
          name=f"t_{n}", embedding_dim=w.shape[1], num_embeddings=w.shape[0],
          feature_names=[n], pooling=torchrec.PoolingType.SUM,
      )
      for n, w in zip(names, weights)
  ]
  ebc = torchrec.EmbeddingBagCollection(tables=configs, device=torch.device("cpu"))
  with torch.no_grad():
    for n, w in zip(names, weights):
      ebc.embedding_bags[f"t_{n}"].weight.copy_(torch.from_numpy(w))
  def kjt(ids):
    values, lengths = zip(*(jagged(ids[n]) for n in names))
    return torchrec.KeyedJaggedTensor.from_lengths_sync(
        keys=list(names), values=torch.from_numpy(np.concatenate(values)),
        lengths=torch.from_numpy(np.concatenate(lengths)),
    )

  kjts = cycle([kjt(ids) for ids in batches])

  def forward():
    return ebc(kjts()).to_dict()

  return forward, torchrec.__version__


def build_fbgemm(names, weights, batches):
  import fbgemm_gpu  # noqa: PLC0415
  from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode  # noqa: PLC0415
  from fbgemm_gpu.split_table_batched_embeddings_ops_training import (  # noqa: PLC0415
      ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen)

  tbe = SplitTableBatchedEmbeddingBagsCodegen(
      embedding_specs=[(w.shape[0], w.shape[1], EmbeddingLocation.HOST, ComputeDevice.CPU)
                       for w in weights],
      pooling_mode=PoolingMode.SUM, device=torch.device("cpu"),
  )
  with torch.no_grad():
    for dst, w in zip(tbe.split_embedding_weights(), weights):
      dst.copy_(torch.from_numpy(w))
  def inputs(ids):
    values, lengths = zip(*(jagged(ids[n]) for n in names))
    lengths = np.concatenate(lengths)   # table-major: [T * B]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return torch.from_numpy(np.concatenate(values)), torch.from_numpy(offsets)

  feeds = cycle([inputs(ids) for ids in batches])
  widths = [w.shape[1] for w in weights]

  def forward():
    out = tbe(*feeds())                    # [B, sum of widths]
    return dict(zip(names, torch.split(out, widths, dim=1)))

  return forward, fbgemm_gpu.__version__


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--data", required=True)
  parser.add_argument("--variant", choices=("ebc", "fbgemm"), default="ebc")
  parser.add_argument("--threads", type=int, default=2)
  parser.add_argument("--check", help="write the first batch's pooled outputs to this .npz")
  parser.add_argument("--warmup", type=int, default=3)
  args = parser.parse_args()

  torch.set_num_threads(args.threads)
  start = time.perf_counter()
  data = np.load(args.data)
  names = [str(n) for n in data["names"]]
  weights = [data[f"w_{n}"] for n in names]
  count = int(data["batches"]) if "batches" in data else 1
  stacked = {n: data[f"ids_{n}"] if "batches" in data else data[f"ids_{n}"][None] for n in names}
  batches = [{n: stacked[n][k] for n in names} for k in range(count)]
  build = build_ebc if args.variant == "ebc" else build_fbgemm
  forward, version = build(names, weights, batches)
  del weights, data
  build_s = time.perf_counter() - start

  def run_steps(n):
    out = None
    with torch.no_grad():
      for _ in range(n):
        out = forward()
    return float(next(iter(out.values()))[0, 0])   # CPU ops are synchronous

  with torch.no_grad():
    if args.check:
      np.savez(args.check, **{f"out_{k}": v.contiguous().numpy() for k, v in forward().items()})
  run_steps(args.warmup)
  serve(run_steps, {
      "torch": torch.__version__, args.variant: version,
      "threads": torch.get_num_threads(),
      "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(unset)"),
      "build_s": build_s, "batches": count,
  })


if __name__ == "__main__":
  main()
