#!/usr/bin/env bash
# Installs the PyTorch / TorchRec peer environment into .peers/ (git-ignored).
#
#     bash benchmarks/install_peers.sh          # from the repository root
#
# The recipe of ../shared/PEERS.md. The versions are pinned because newer
# ones of the same packages fail on the CPU machines (fbgemm-gpu-cpu 1.9.0
# does not import with torch 2.13; torchrec's own dependencies pull the CUDA
# fbgemm, hence --no-deps). The peers live in their own venv so they never
# touch embedlib's dependencies. Benchmarks run without .peers/ and skip the
# peer columns with a note. Re-running is harmless: pip skips what is there.
set -euo pipefail

cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"

if [[ ! -x .peers/bin/python ]]; then
  "$PY" -m venv .peers
fi
.peers/bin/pip install torch==2.13.0 numpy        # the CPU build on this machine
.peers/bin/pip install fbgemm-gpu-cpu==1.8.0       # 1.9.0 fails to import with torch 2.13
.peers/bin/pip install --no-deps torchrec==1.8.0   # torchrec's own deps pull the CUDA fbgemm
.peers/bin/pip install tensordict torchmetrics==1.0.3 tqdm pyre-extensions

.peers/bin/python - <<'EOF'
import torch, fbgemm_gpu, torchrec  # noqa: F401
from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection  # noqa: F401
print(f"peers ready: torch {torch.__version__}, torchrec {torchrec.__version__}, "
      f"{torch.get_num_threads()} threads")
EOF
