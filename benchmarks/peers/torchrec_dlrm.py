"""TorchRec DLRM training worker for ``benchmarks/train_dlrm.py`` (runs in ``.peers``).

    .peers/bin/python benchmarks/peers/torchrec_dlrm.py --data BATCHES.npz \
        --tables 1460,583,... [--variant fused|frozen] [--threads 2]

Started by ``train_dlrm.py``, which sends it ``run`` requests (see
``worker_protocol.py``); not meant to be run by hand. Reads the same
synthetic batches as the JAX side from an ``.npz`` (``dense [N, B, 13]``
float32, ``sparse [N, B, 26]`` int32, ``label [N, B]`` float32) and trains
``torchrec.models.dlrm.DLRM`` (bottom MLP 13-512-256-64, dot interaction,
top MLP 512-256-1: the same shapes as ``embedlib.models.DLRM``) on them,
cycling through the batches.

Variants:

- ``fused``: ``FusedEmbeddingBagCollection`` with FBGEMM's fused
  ``EXACT_ROWWISE_ADAGRAD`` (the table update runs inside the backward
  pass; this is the only unsharded path to FBGEMM's update, see
  ``../shared/PEERS.md``), ``torch.optim.Adagrad`` on the MLPs.
- ``frozen``: a plain ``EmbeddingBagCollection`` with its tables frozen
  (``requires_grad=False``), Adagrad on the MLPs: the MLP-only ceiling.

Both draw their initial values from the JAX model's distributions and train
the MLPs with optax.adagrad's rule (``like_flax``, ``build``), so the losses
compare; the values themselves differ.

Batches become ``KeyedJaggedTensor`` s (26 keys, one id per sample) before
any timing, as the JAX side puts its batches on the device first. Nothing is
run under ``torch.inference_mode()`` (FBGEMM's CPU kernel fails under it).
"""

import argparse
import os
import sys

import numpy as np
import torch
import torchrec
from torchrec.models.dlrm import DLRM
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from worker_protocol import serve  # noqa: E402


def to_kjt(sparse: np.ndarray, keys: list[str]) -> KeyedJaggedTensor:
  """``[B, F]`` single-hot ids -> a KJT (values key-major, every length 1)."""
  batch, num = sparse.shape
  return KeyedJaggedTensor.from_lengths_sync(
      keys=keys,
      values=torch.from_numpy(np.ascontiguousarray(sparse.T).reshape(-1).astype(np.int64)),
      lengths=torch.ones(batch * num, dtype=torch.int32),
  )


def build(args, sizes, dim):
  keys = [f"f{i}" for i in range(len(sizes))]
  configs = [
      EmbeddingBagConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=n,
                         feature_names=[keys[i]])
      for i, n in enumerate(sizes)
  ]
  if args.variant == "fused":
    tables = FusedEmbeddingBagCollection(
        tables=configs, optimizer_type=torchrec.optim.RowWiseAdagrad,
        optimizer_kwargs={"lr": args.sparse_lr, "eps": 1e-8},
        device=torch.device("cpu"))
  else:
    tables = torchrec.EmbeddingBagCollection(tables=configs, device=torch.device("cpu"))
  model = DLRM(
      embedding_bag_collection=tables,
      dense_in_features=args.num_dense,
      dense_arch_layer_sizes=list(args.bottom) + [dim],
      over_arch_layer_sizes=list(args.top),
  )
  like_flax(model, tables)
  if args.variant == "frozen":
    for p in tables.parameters():
      p.requires_grad_(False)
  # The fused collection registers its FBGEMM weights as parameters too; they
  # must stay out of the dense optimizer (Adagrad would allocate state for them).
  dense = [p for n, p in model.named_parameters()
           if not n.startswith("sparse_arch.") and p.requires_grad]
  # optax.adagrad's defaults, as the JAX side's MLPs train (torch's own are
  # accumulators from 0 and eps 1e-10, whose first steps are lr per weight:
  # another rule). optax adds eps under the square root, torch after it:
  # with accumulators from 0.1 the difference is below float32 rounding.
  return keys, model, torch.optim.Adagrad(dense, lr=args.dense_lr,
                                          initial_accumulator_value=0.1, eps=1e-7)


def _flax_normal(weight, fan_in):
  """flax's variance-scaling truncated normal (scale 1, fan in): its embeddings' and kernels' init."""
  std = (1.0 / fan_in) ** 0.5 / 0.87962566103423978  # the std of a normal cut at 2 sigma
  torch.nn.init.trunc_normal_(weight, std=std, a=-2 * std, b=2 * std)


def like_flax(model, tables):
  """Initial values drawn as the JAX model's: flax's ``default_embed_init`` for the
  tables, ``lecun_normal`` kernels and zero biases for the MLPs (not the same
  values: the same distributions, where torch's defaults draw tables of n rows
  from U(-1/sqrt(n), 1/sqrt(n)) and Linear layers from another uniform)."""
  with torch.no_grad():
    for weight in tables.state_dict().values():   # FBGEMM's storage for the fused one
      _flax_normal(weight, weight.shape[1])
    for module in model.modules():
      if isinstance(module, torch.nn.Linear):
        _flax_normal(module.weight, module.in_features)
        torch.nn.init.zeros_(module.bias)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--data", required=True)
  parser.add_argument("--tables", required=True, help="comma-separated table sizes")
  parser.add_argument("--variant", choices=("fused", "frozen"), default="fused")
  parser.add_argument("--threads", type=int, default=2)
  parser.add_argument("--dim", type=int, default=64)
  parser.add_argument("--num-dense", type=int, default=13)
  parser.add_argument("--bottom", type=lambda s: [int(x) for x in s.split(",")], default=[512, 256])
  parser.add_argument("--top", type=lambda s: [int(x) for x in s.split(",")], default=[512, 256, 1])
  parser.add_argument("--dense-lr", type=float, default=0.01)
  parser.add_argument("--sparse-lr", type=float, default=0.05)
  parser.add_argument("--warmup", type=int, default=3)
  args = parser.parse_args()

  torch.set_num_threads(args.threads)
  torch.manual_seed(0)
  sizes = [int(x) for x in args.tables.split(",")]
  keys, model, opt = build(args, sizes, args.dim)
  data = np.load(args.data)
  batches = [
      (torch.from_numpy(d), to_kjt(s, keys), torch.from_numpy(y))
      for d, s, y in zip(data["dense"], data["sparse"], data["label"])
  ]
  loss_fn = torch.nn.BCEWithLogitsLoss()
  model.train()
  position = [0]

  def run_steps(n):
    """The mean loss of the ``n`` steps (as the JAX workers'): one step's is noisy."""
    losses = []
    for _ in range(n):
      dense, kjt, label = batches[position[0] % len(batches)]
      position[0] += 1
      opt.zero_grad(set_to_none=True)
      loss = loss_fn(model(dense, kjt).squeeze(-1), label)
      loss.backward()   # the fused collection updates its tables here
      opt.step()
      losses.append(loss.detach())
    return torch.stack(losses).mean().item()

  first = run_steps(args.warmup)
  serve(run_steps, {
      "torch": torch.__version__, "torchrec": torchrec.__version__,
      "threads": torch.get_num_threads(),
      "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(unset)"),
      "first_loss": first,
  })


if __name__ == "__main__":
  main()
