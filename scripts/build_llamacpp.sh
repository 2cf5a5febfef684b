#!/usr/bin/env bash
# Build llama.cpp's llama-bench, llama-perplexity and llama-completion (CPU only, native ISA) as a
# peer to compare MIRAGE against. In the vendored llama.cpp, `llama-completion` is the classic
# prompt-in/text-out CLI; `llama-cli` became a chat client built on the server code
# (LLAMA_BUILD_SERVER, with the web UI), which takes far longer to compile, so it is only built
# when LLAMACPP_WITH_CLI=1. The source is the llama.cpp tree vendored inside the PyPI sdist of
# llama-cpp-python, because no git host is reachable here but the package registry is.
#
# Everything lands under target/llamacpp/ (git-ignored). Idempotent: exits early when all three
# binaries already exist. Usage: [LLAMACPP_WITH_CLI=1] scripts/build_llamacpp.sh [JOBS]   (default JOBS=2)
#
# LLAMACPP_NO_AMX=1 builds without Intel AMX (-mno-amx-*): on an Intel Xeon VM whose CPU flags
# list AMX, every llama-bench run of the native build died with SIGSEGV in
# ggml_backend_amx_mul_mat (llama-bench --repack 0, which skips that path, ran).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="$ROOT/target/llamacpp"
JOBS="${1:-2}"
BIN_NAMES=(llama-bench llama-perplexity llama-completion)
BUILD_SERVER=OFF
if [[ "${LLAMACPP_WITH_CLI:-0}" == 1 ]]; then
    BIN_NAMES+=(llama-cli)
    BUILD_SERVER=ON
fi

find_bin_dir() {
    # The build tree is target/llamacpp/build/bin once it has been built.
    local dir="$WORK/build/bin"
    for name in "${BIN_NAMES[@]}"; do
        [[ -x "$dir/$name" ]] || return 1
    done
    echo "$dir"
}

if dir="$(find_bin_dir)"; then
    echo "llama.cpp binaries already built in $dir"
    for name in "${BIN_NAMES[@]}"; do echo "  $dir/$name"; done
    exit 0
fi

if ! command -v cmake >/dev/null 2>&1; then
    echo "cmake missing; installing it with apt-get" >&2
    apt-get install -y cmake || { apt-get update && apt-get install -y cmake; }
fi

mkdir -p "$WORK/sdist"
shopt -s nullglob
sdists=("$WORK"/sdist/llama_cpp_python-*.tar.gz)
if [[ ${#sdists[@]} -eq 0 ]]; then
    python3 -m pip download --no-deps --no-binary :all: llama-cpp-python -d "$WORK/sdist"
    sdists=("$WORK"/sdist/llama_cpp_python-*.tar.gz)
fi
[[ ${#sdists[@]} -ge 1 ]] || { echo "no llama-cpp-python sdist found in $WORK/sdist" >&2; exit 1; }
SDIST="${sdists[-1]}"

SRC_PARENT="$WORK/src"
if [[ ! -d "$SRC_PARENT" ]]; then
    mkdir -p "$SRC_PARENT.tmp"
    tar -xzf "$SDIST" -C "$SRC_PARENT.tmp"
    mv "$SRC_PARENT.tmp" "$SRC_PARENT"
fi
# The sdist unpacks to llama_cpp_python-X.Y.Z/vendor/llama.cpp.
LLAMA_SRC="$(echo "$SRC_PARENT"/llama_cpp_python-*/vendor/llama.cpp)"
[[ -f "$LLAMA_SRC/CMakeLists.txt" ]] || { echo "vendored llama.cpp not found under $SRC_PARENT" >&2; exit 1; }
echo "llama.cpp source: $LLAMA_SRC (from $(basename "$SDIST"))"

NO_AMX=()
if [[ "${LLAMACPP_NO_AMX:-0}" == 1 ]]; then
    NO_AMX=(-DCMAKE_C_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
        -DCMAKE_CXX_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16")
fi
cmake -S "$LLAMA_SRC" -B "$WORK/build" \
    -DCMAKE_BUILD_TYPE=Release \
    "${NO_AMX[@]}" \
    -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF \
    -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_SERVER="$BUILD_SERVER"
cmake --build "$WORK/build" --config Release -j "$JOBS" --target "${BIN_NAMES[@]}"

dir="$(find_bin_dir)" || { echo "build finished but binaries are missing in $WORK/build/bin" >&2; exit 1; }
echo "llama.cpp binaries built in $dir"
for name in "${BIN_NAMES[@]}"; do echo "  $dir/$name"; done
