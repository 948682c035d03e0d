#!/usr/bin/env bash
# Build llama.cpp's llama-server from the source vendored in the PyPI sdist of llama-cpp-python
# (no other download), with native CPU flags, for `specmesh bench --baselines llama-server`.
#
#   bash benchmarks/build_llama_server.sh [DEST]     # DEST defaults to ~/.cache/specmesh/llama.cpp
#
# Prints the path of the built binary last. Needs cmake and a C++ compiler (apt-get install
# cmake g++). About 8 minutes on 2 cores.
set -euo pipefail
DEST="${1:-${SPECMESH_CACHE_DIR:-$HOME/.cache/specmesh}/llama.cpp}"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-}"  # pin a llama-cpp-python version; empty: the newest
mkdir -p "$DEST"
BIN="$DEST/build/bin/llama-server"
if [ -x "$BIN" ]; then echo "$BIN"; exit 0; fi
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
python3 -m pip download --no-deps --no-binary :all: -d "$WORK" \
    "llama-cpp-python${VERSION:+==$VERSION}" >&2
tar -xzf "$WORK"/llama_cpp_python-*.tar.gz -C "$WORK"
SRC="$(echo "$WORK"/llama_cpp_python-*/vendor/llama.cpp)"
rm -rf "$DEST/src" && cp -r "$SRC" "$DEST/src"
cmake -S "$DEST/src" -B "$DEST/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=ON >&2
cmake --build "$DEST/build" --target llama-server -j "$(nproc)" >&2
echo "$BIN"
