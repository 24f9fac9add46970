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
output). With ``--artifact`` its weights are the embedlib artifact's (its
int8 tables dequantized into the float collection, then quantized again by
TorchRec), so the scores can be compared (``--dump``); without, its own
random ones.

Each timed batch starts from the numpy arrays, as the JAX side's does: the
``KeyedJaggedTensor`` is built inside the timing, then the forward and the
sigmoid run under ``torch.no_grad()`` (FBGEMM's CPU kernel fails under
``torch.inference_mode()``).
"""

import argparse
import json
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


def _weights(directory):
  """``{name: array}`` of an embedlib artifact's weights (its manifest and ``.npy`` files)."""
  with open(os.path.join(directory, "manifest.json")) as f:
    manifest = json.load(f)
  weights = {w["name"]: np.load(os.path.join(directory, w["file"]), mmap_mode="r",
                                allow_pickle=False) for w in manifest["weights"]}
  return manifest, weights


def load_artifact(directory, model, tables):
  """Copies an embedlib int8 DLRM artifact's weights into ``model`` (float tables dequantized).

  Both DLRMs concatenate the bottom MLP's output and the tables' vectors in
  feature order, take the pairwise dots above the diagonal row by row, and
  put the bottom output first: the top MLP's first kernel maps one to one.
  """
  manifest, w = _weights(directory)

  def linear(layer, prefix):
    layer.weight.copy_(torch.from_numpy(np.ascontiguousarray(w[f"{prefix}['kernel'].value"].T)))
    layer.bias.copy_(torch.from_numpy(np.array(w[f"{prefix}['bias'].value"])))

  with torch.no_grad():
    for i, p in enumerate(model.dense_arch.model._mlp):
      linear(p._linear, f"['bottom']['layers'][{i}]")
    mlp = model.over_arch.model[0]._mlp
    for i, p in enumerate(mlp):
      linear(p._linear, f"['top']['layers'][{i}]")
    linear(model.over_arch.model[1], f"['top']['layers'][{len(mlp)}]")
    for i, feature in enumerate(manifest["data"]["features"]):
      prefix = f"['embeddings']['tables']['{feature['name']}']['table'].value"
      codes, scale_bias = w[prefix + ".data"], w[prefix + ".scale_bias"]
      rows = tables.embedding_bags[f"t{i}"].weight
      for start in range(0, rows.shape[0], 1 << 16):  # a float copy of a block at a time
        sb = np.asarray(scale_bias[start:start + (1 << 16), 0], np.float32)
        block = np.asarray(codes[start:start + (1 << 16)], np.float32) * sb[:, :1] + sb[:, 1:]
        rows[start:start + len(block)] = torch.from_numpy(block)


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
  if args.artifact:
    load_artifact(args.artifact, model, tables)
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
  parser.add_argument("--artifact", help="an embedlib int8 DLRM artifact whose weights to use")
  parser.add_argument("--dump", help="write the first batch's probabilities here (.npy)")
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

  if args.dump:
    with torch.no_grad():
      dense, sparse = batches[0]
      np.save(args.dump, torch.sigmoid(model(torch.from_numpy(dense), to_kjt(sparse, keys)))
              .squeeze(-1).numpy())
  first = run_steps(args.warmup)
  serve(run_steps, {
      "torch": torch.__version__, "torchrec": torchrec.__version__,
      "threads": torch.get_num_threads(), "table_bytes": table_bytes,
      "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(unset)"), "first_mean": first,
  })


if __name__ == "__main__":
  main()
