#!/usr/bin/env bash
# Installs the PyTorch / TorchRec / RecBole peer environment into .peers/ (git-ignored).
#
#     bash benchmarks/install_peers.sh          # from the repository root
#
# The recipe of ../shared/PEERS.md. The versions are pinned because newer
# ones of the same packages fail on the CPU machines (fbgemm-gpu-cpu 1.9.0
# does not import with torch 2.13; torchrec's own dependencies pull the CUDA
# fbgemm, hence --no-deps). The peers live in their own venv so they never
# touch embedlib's dependencies. Benchmarks run without .peers/ and skip the
# peer columns with a note. Re-running is harmless: pip skips what is there.
# RecBole 1.2.1 imports ray 2.6.3, which uses np.bool8 and pkg_resources:
# hence numpy < 2 (and so pandas < 3) and setuptools < 81; torch 2.13 and
# torchrec run with that numpy. pip runs as `python -m pip` so that a copied
# .peers/ (whose pip script names the original's python) installs into itself.
set -euo pipefail

cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"

if [[ ! -x .peers/bin/python ]]; then
  "$PY" -m venv .peers
fi
PIP=(.peers/bin/python -m pip)
"${PIP[@]}" install torch==2.13.0 numpy        # the CPU build on this machine
"${PIP[@]}" install fbgemm-gpu-cpu==1.8.0       # 1.9.0 fails to import with torch 2.13
"${PIP[@]}" install --no-deps torchrec==1.8.0   # torchrec's own deps pull the CUDA fbgemm
"${PIP[@]}" install tensordict torchmetrics==1.0.3 tqdm pyre-extensions
"${PIP[@]}" install recbole==1.2.1 'numpy<2' 'pandas<3' 'setuptools<81'

.peers/bin/python - <<'EOF'
import torch, fbgemm_gpu, torchrec, recbole  # noqa: F401
from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection  # noqa: F401
from recbole.quick_start import run_recbole  # noqa: F401
print(f"peers ready: torch {torch.__version__}, torchrec {torchrec.__version__}, "
      f"recbole {recbole.__version__}, {torch.get_num_threads()} threads")
EOF
