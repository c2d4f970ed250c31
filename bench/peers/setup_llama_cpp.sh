#!/usr/bin/env bash
# Make bench/peers/.venv-llama with llama-cpp-python built from source (CPU, ~5 min on 2 cores)
# and the vendored llama.cpp converter (convert_hf_to_gguf.py + gguf-py) kept in
# bench/peers/.src-llama so that HF checkpoints can be turned into GGUF files.
#
#   bash bench/peers/setup_llama_cpp.sh
#
# The converter needs torch: the CPU build 2.13.0 is pinned by a constraint file.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
VENV="${HERE}/.venv-llama"
SRC="${HERE}/.src-llama"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
PY="${PYTHON:-python3.11}"
CONSTRAINT="$(mktemp)"
trap 'rm -f "$CONSTRAINT"' EXIT
echo "torch==2.13.0+cpu" > "$CONSTRAINT"
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -c "$CONSTRAINT" "torch==2.13.0+cpu"
rm -rf "$SRC" && mkdir -p "$SRC"
"$VENV/bin/pip" download --no-deps --no-binary :all: -d "$SRC" "llama-cpp-python==${VERSION}"
tar -xzf "$SRC"/llama_cpp_python-*.tar.gz -C "$SRC"
PKG="$(ls -d "$SRC"/llama_cpp_python-*/)"
ln -sfn "$PKG" "$SRC/pkg"
CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON -DGGML_OPENMP=ON -DLLAMA_CURL=OFF}" \
  "$VENV/bin/pip" install -v -c "$CONSTRAINT" "$PKG"
# converter dependencies: the vendored gguf-py, transformers and friends
"$VENV/bin/pip" install -c "$CONSTRAINT" "$PKG/vendor/llama.cpp/gguf-py" numpy sentencepiece "transformers>=4.57" safetensors protobuf
"$VENV/bin/python" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__)"
ls "$PKG/vendor/llama.cpp/convert_hf_to_gguf.py"
