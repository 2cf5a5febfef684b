#!/usr/bin/env bash
# The llama.cpp GPU peer: build llama.cpp's llama-bench with CUDA on the GPU machine and run it
# beside `mirage-cli bench --backend cuda` on the same GGUF files, in one run, printing one table.
#
# The GPU machine has no network and no Rust, so this works in two steps:
#
#   benches/gpu_peer.sh pack OUT.tar.xz
#       (here) packs the llama.cpp tree vendored in the PyPI llama-cpp-python sdist (fetched by
#       scripts/build_llamacpp.sh into target/llamacpp/), trimmed to what a CUDA build of llama-bench needs
#       (no models/, docs/, web UI or non-CUDA/CPU ggml backends): about 6 MiB.
#
#   benches/gpu_peer.sh build SRC.tar.xz BUILD_DIR
#       (there) unpacks and builds llama-bench for sm_90 with CUDA, FlashAttention kernels off
#       (GGML_CUDA_FA=OFF keeps the build near 5 minutes on 16 cores). Idempotent.
#
#   benches/gpu_peer.sh build-fa SRC.tar.xz BUILD_DIR
#       (here, no GPU needed) builds llama-bench for sm_90 with the FlashAttention kernels
#       (GGML_CUDA_FA=ON, the `-fa 1` peer), too long a build for one call on the GPU machine
#       (about 30 minutes on 2 cores here). Fetches the CUDA 13.0 compiler, runtime and cuBLAS
#       wheels from PyPI into BUILD_DIR/cuda (~1.2 GB unpacked; the GPU machine's driver is CUDA
#       13.0), links against a stub libcuda.so (the real one is the GPU machine's), and leaves
#       BUILD_DIR/llama-bench-fa.tar.xz (the stripped binary, ~40 MiB) to carry there.
#
#   benches/gpu_peer.sh compare LLAMA_BENCH MIRAGE_CLI MODEL.gguf [MODEL.gguf ...]
#       (there) for each model: llama-bench -p 512 -n 128 -ngl 99 -r 3 (JSON) and
#       mirage-cli bench --backend cuda --prompt 512 --gen 128 --json, then a markdown table with the
#       ratios. Environment: PEER_REPS (default 3), PEER_OUT (directory for the raw JSON, default .).
set -euo pipefail

cmd="${1:-}"; shift || true
case "$cmd" in
pack)
    out="${1:?usage: gpu_peer.sh pack OUT.tar.xz}"
    root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    src="$(echo "$root"/target/llamacpp/src/llama_cpp_python-*/vendor/llama.cpp)"
    [[ -f "$src/CMakeLists.txt" ]] || { echo "no vendored llama.cpp under target/llamacpp/src; run scripts/build_llamacpp.sh first" >&2; exit 1; }
    base="$(dirname "$src")"
    excl=(--exclude=llama.cpp/models --exclude=llama.cpp/docs --exclude=llama.cpp/media --exclude=llama.cpp/tools/ui
          --exclude=llama.cpp/tools/server/public --exclude=llama.cpp/gguf-py --exclude=llama.cpp/benches
          --exclude=llama.cpp/tests --exclude=llama.cpp/conversion --exclude=llama.cpp/.git)
    for b in "$src"/ggml/src/ggml-*/; do
        name="$(basename "$b")"
        case "$name" in ggml-cuda|ggml-cpu) ;; *) excl+=("--exclude=llama.cpp/ggml/src/$name") ;; esac
    done
    tmp="$out.tmp.$$"
    tar -C "$base" "${excl[@]}" -cJf "$tmp" llama.cpp
    mv "$tmp" "$out"
    ls -l "$out"
    ;;
build)
    tarball="${1:?usage: gpu_peer.sh build SRC.tar.xz BUILD_DIR}"; dir="${2:?build dir}"
    if [[ -x "$dir/build/bin/llama-bench" ]]; then echo "llama-bench already built in $dir/build/bin"; exit 0; fi
    mkdir -p "$dir"
    tar -C "$dir" -xJf "$tarball"
    # The trimmed tree keeps only the CPU and CUDA backends; tell ggml's CMake not to look for others.
    gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
    cmake -S "$dir/llama.cpp" -B "$dir/build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release \
        -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_CUDA_FA=OFF -DGGML_NATIVE=ON \
        -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF >"$dir/cmake.log" 2>&1 \
        || { tail -40 "$dir/cmake.log"; exit 1; }
    cmake --build "$dir/build" --target llama-bench -j "$(nproc)" >"$dir/build.log" 2>&1 \
        || { tail -60 "$dir/build.log"; exit 1; }
    ls -l "$dir/build/bin/llama-bench"
    ;;
build-fa)
    tarball="${1:?usage: gpu_peer.sh build-fa SRC.tar.xz BUILD_DIR}"; dir="${2:?build dir}"
    mkdir -p "$dir" && dir="$(cd "$dir" && pwd)"
    cuda="$dir/cuda/nvidia/cu13"
    if [[ ! -x "$cuda/bin/nvcc" ]]; then
        python3 -m pip download --no-deps -d "$dir/wheels" nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 \
            nvidia-cuda-crt==13.0.88 nvidia-cuda-runtime==13.0.96 nvidia-cublas==13.0.2.14 nvidia-cuda-cccl==13.0.85
        for w in "$dir"/wheels/*.whl; do python3 -m zipfile -e "$w" "$dir/cuda"; done
        chmod -R +x "$cuda/bin" "$cuda/nvvm/bin"
        for l in cudart cublas cublasLt; do ln -sf "lib$l.so.13" "$cuda/lib/lib$l.so"; done
        ln -sfn lib "$cuda/lib64"
    fi
    [[ -d "$dir/llama.cpp" ]] || tar -C "$dir" -xJf "$tarball"
    # ggml-cuda's memory pool calls the driver API: the link needs a libcuda.so that names those
    # functions (the GPU machine's libcuda.so.1 provides them at run time).
    mkdir -p "$dir/stub"
    printf 'int %s(void) { return 0; }\n' cuDeviceGet cuDeviceGetAttribute cuGetErrorString cuMemAddressFree \
        cuMemAddressReserve cuMemCreate cuMemGetAllocationGranularity cuMemMap cuMemRelease cuMemSetAccess \
        cuMemUnmap >"$dir/stub/libcuda.c"
    gcc -shared -fPIC -Wl,-soname,libcuda.so.1 "$dir/stub/libcuda.c" -o "$dir/stub/libcuda.so"
    PATH="$cuda/bin:$PATH" cmake -S "$dir/llama.cpp" -B "$dir/build" -DCMAKE_BUILD_TYPE=Release \
        -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_CUDA_FA=ON -DGGML_NATIVE=OFF \
        -DCMAKE_CUDA_COMPILER="$cuda/bin/nvcc" -DCUDAToolkit_ROOT="$cuda" \
        -DCUDA_cuda_driver_LIBRARY="$dir/stub/libcuda.so" \
        -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF >"$dir/cmake.log" 2>&1 \
        || { tail -40 "$dir/cmake.log"; exit 1; }
    PATH="$cuda/bin:$PATH" nice cmake --build "$dir/build" --target llama-bench -j "$(nproc)" >"$dir/build.log" 2>&1 \
        || { grep -E "error|undefined" "$dir/build.log" | head -20; exit 1; }
    s="$(mktemp -d)"
    cp "$dir/build/bin/llama-bench" "$s/" && strip "$s/llama-bench"
    tar -C "$s" -cJf "$dir/llama-bench-fa.tar.xz.tmp" llama-bench && mv "$dir/llama-bench-fa.tar.xz.tmp" "$dir/llama-bench-fa.tar.xz"
    rm -rf "$s"
    ls -l "$dir/llama-bench-fa.tar.xz"
    ;;
compare)
    lb="${1:?usage: gpu_peer.sh compare LLAMA_BENCH MIRAGE_CLI MODEL...}"; mc="${2:?mirage-cli}"; shift 2
    reps="${PEER_REPS:-3}"; outdir="${PEER_OUT:-.}"; mkdir -p "$outdir"
    rows=()
    for m in "$@"; do
        name="$(basename "$m" .gguf)"
        "$lb" -m "$m" -p 512 -n 128 -ngl 99 -r "$reps" -o json >"$outdir/llama-$name.json" 2>"$outdir/llama-$name.err" \
            || { echo "llama-bench failed on $m:"; tail -5 "$outdir/llama-$name.err"; continue; }
        "$mc" bench --backend cuda --model "$m" --prompt 512 --gen 128 --json >"$outdir/mirage-$name.json" 2>"$outdir/mirage-$name.err" \
            || { echo "mirage-cli bench failed on $m:"; tail -5 "$outdir/mirage-$name.err"; continue; }
        rows+=("$(python3 - "$outdir/llama-$name.json" "$outdir/mirage-$name.json" "$name" <<'PY'
import json, sys
ll = json.load(open(sys.argv[1])); mi = json.load(open(sys.argv[2])); name = sys.argv[3]
pp = next(r["avg_ts"] for r in ll if r["n_prompt"] > 0 and r["n_gen"] == 0)
tg = next(r["avg_ts"] for r in ll if r["n_gen"] > 0 and r["n_prompt"] == 0)
mp, md = mi["prompt_tok_s"], mi["decode_tok_s"]
print(f"| {name} | {mp:.0f} | {pp:.0f} | {mp/pp:.2f}x | {md:.1f} | {tg:.1f} | {md/tg:.2f}x |")
PY
)")
    done
    echo
    echo "| model | MIRAGE pp512 tok/s | llama.cpp pp512 tok/s | ratio | MIRAGE tg128 tok/s | llama.cpp tg128 tok/s | ratio |"
    echo "|---|---:|---:|---:|---:|---:|---:|"
    printf '%s\n' "${rows[@]}"
    ;;
*)
    sed -n '2,27p' "$0"; exit 2 ;;
esac
