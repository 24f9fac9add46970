"""TorchRec quantized-inference DLRM scoring worker for ``benchmarks/serving.py`` (runs in ``.peers``).

    .peers/bin/python benchmarks/peers/torchrec_serving.py --data BATCHES.npz \
        --tables 100000,100000,... [--dtype int8] [--threads 2]

Started by ``serving.py``, which sends it ``run`` requests (see
``worker_protocol.py``); ``run n`` scores the next ``n`` batches. Reads the
batches the JAX side scores from an ``.npz`` (``dense [N, B, 13]`` float32,
``sparse [N, B, 26]`` int32) and builds ``torchrec.models.dlrm.DLRM``
(bottom MLP 13-512-256-64, dot interaction, top MLP 512-256-1: the shapes
of ``embedlib.models.DLRM`` under ``configs/dlrm_criteo.py``) whose
``EmbeddingBagCollection`` is replaced by the quantized inference one
(``torchrec.quant.EmbeddingBagCollection.from_float``: FBGEMM's inference
table-batched embedding, int8 rows with an fp16 scale and bias, float32
output). Its weights are its own random ones: the work per example is the
JAX side's, the scores are not compared.

Each timed batch starts from the numpy arrays, as the JAX side's does: the
``KeyedJaggedTensor`` is built inside the timing, then the forward and the
sigmoid run under ``torch.no_grad()`` (FBGEMM's CPU kernel fails under
``torch.inference_mode()``).
"""

import argparse
import os
import sys

import numpy as np
import torch
import torchrec
from torch import quantization as quant
from torchrec.models.dlrm import DLRM
from torchrec.modules.embedding_configs import EmbeddingBagConfig, QuantConfig
from torchrec.quant.embedding_modules import EmbeddingBagCollection as QuantEBC

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torchrec_dlrm import to_kjt  # noqa: E402
from worker_protocol import serve  # noqa: E402

DTYPES = {"int8": torch.qint8, "int4": torch.quint4x2}


def build(args, sizes):
  keys = [f"f{i}" for i in range(len(sizes))]
  configs = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=args.dim, num_embeddings=n,
                                feature_names=[keys[i]]) for i, n in enumerate(sizes)]
  tables = torchrec.EmbeddingBagCollection(tables=configs, device=torch.device("cpu"))
  model = DLRM(embedding_bag_collection=tables, dense_in_features=args.num_dense,
               dense_arch_layer_sizes=list(args.bottom) + [args.dim],
               over_arch_layer_sizes=list(args.top))
  tables.qconfig = QuantConfig(
      activation=quant.PlaceholderObserver.with_args(dtype=torch.float),
      weight=quant.PlaceholderObserver.with_args(dtype=DTYPES[args.dtype]))
  quantized = QuantEBC.from_float(tables)
  model.sparse_arch.embedding_bag_collection = quantized
  model.eval()
  table_bytes = sum(t.numel() * t.element_size() for t in quantized.state_dict().values())
  return keys, model, table_bytes


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--data", required=True)
  parser.add_argument("--tables", required=True, help="comma-separated table sizes")
  parser.add_argument("--dtype", choices=tuple(DTYPES), default="int8")
  parser.add_argument("--threads", type=int, default=2)
  parser.add_argument("--dim", type=int, default=64)
  parser.add_argument("--num-dense", type=int, default=13)
  parser.add_argument("--bottom", type=lambda s: [int(x) for x in s.split(",")], default=[512, 256])
  parser.add_argument("--top", type=lambda s: [int(x) for x in s.split(",")], default=[512, 256, 1])
  parser.add_argument("--warmup", type=int, default=2)
  args = parser.parse_args()

  torch.set_num_threads(args.threads)
  torch.manual_seed(0)
  sizes = [int(x) for x in args.tables.split(",")]
  keys, model, table_bytes = build(args, sizes)
  data = np.load(args.data)
  batches = list(zip(data["dense"], data["sparse"]))
  position = [0]

  def run_steps(n):
    total = 0.0
    with torch.no_grad():
      for _ in range(n):
        dense, sparse = batches[position[0] % len(batches)]
        position[0] += 1
        probability = torch.sigmoid(model(torch.from_numpy(dense), to_kjt(sparse, keys)))
        total = float(probability.mean())
    return total

  first = run_steps(args.warmup)
  serve(run_steps, {
      "torch": torch.__version__, "torchrec": torchrec.__version__,
      "threads": torch.get_num_threads(), "table_bytes": table_bytes,
      "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(unset)"), "first_mean": first,
  })


if __name__ == "__main__":
  main()
