#!/usr/bin/env bash
# Device-side run for the CUDA-graph / split-K attention / cuBLAS prefill /
# f16 KV work (see ../NOTES.md). Carried: .devbin-c/bins.tar.xz (mirage-cli
# and the `kernels` test binary, release, stripped) and .devbin-c/smol10.gguf
# (SmolLM2 cut to its first 10 blocks by scripts/truncate_gguf_blocks.py).
# `h200-graphs.sh` runs the kernel tests and the benches; `h200-graphs.sh 2`
# only the benches (graphs on/off alternated, GEMM on/off at 512 and 4000
# prompt tokens, f16 KV at 4000).
set -uo pipefail
phase=${1:-1}
W=/tmp/m
OUT=${OUT:-/tmp/out}
mkdir -p "$W" "$OUT"
tar -xJf .devbin-c/bins.tar.xz -C "$W" || exit 1
NV=$(find /usr/local/cuda* /usr/local/lib /opt /usr/lib -name 'libnvrtc.so*' 2>/dev/null | grep -v stub | head -1)
export LD_LIBRARY_PATH="$(dirname "${NV:-/x/y}"):${LD_LIBRARY_PATH:-}"
export MIRAGE_CUDA_CACHE=$W/cache
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
echo "nvrtc: ${NV:-none}; cublas: $(ls "$(dirname "${NV:-/x/y}")"/libcublas.so* 2>/dev/null | head -1)"
if [ "$phase" = 1 ]; then
MIRAGE_REQUIRE_CUDA_TESTS=1 timeout 70 "$W/kernels" --nocapture --test-threads 1 --skip smollm2 > "$OUT/kernels.log" 2>&1
echo "kernels rc=$?"
grep -E "^test |cosine|rel err [0-9]|result:|panicked" "$OUT/kernels.log" | grep -v "long attention" | head -40
grep -E "long attention" "$OUT/kernels.log" | tail -4
fi
M=.devbin-c/smol10.gguf
B="$W/mirage-cli bench --model $M"
run() { local tag=$1; shift; timeout 20 $B "$@" --json > "$OUT/bench_$tag.json" 2> "$OUT/bench_$tag.err"; echo "$tag rc=$? $(cat "$OUT/bench_$tag.json" | tr -d '\n' | sed -E 's/.*"prompt_tok_s":([0-9.]+).*"decode_tok_s":([0-9.]+),"decode_ms_median":([0-9.]+).*"peak_device_bytes":([0-9a-z]+),"weights_bytes":([0-9a-z]+),"kv_cache_bytes":([0-9a-z]+),"workspace_bytes":([0-9a-z]+).*"graph_captures":([0-9a-z]+),"graph_replays":([0-9a-z]+).*/pp=\1 tg=\2 med_ms=\3 peak=\4 w=\5 kv=\6 ws=\7 cap=\8 rep=\9/')"; }
if [ "$phase" = 2 ]; then
  for i in 1 2; do
    run g_on$i --backend cuda --prompt 512 --gen 128 --cuda-graphs on
    run g_off$i --backend cuda --prompt 512 --gen 128 --cuda-graphs off
  done
  for p in 512 4000; do
    run gemm_on_$p --backend cuda --prompt $p --gen 8 --cuda-gemm on
    run gemm_off_$p --backend cuda --prompt $p --gen 8 --cuda-gemm off
  done
  run long_kv32 --backend cuda --prompt 4000 --gen 128
  run long_kv16 --backend cuda --prompt 4000 --gen 128 --kv f16
  run cpu --backend cpu --prompt 512 --gen 128
  exit 0
fi
run g_on --backend cuda --prompt 512 --gen 128 --cuda-graphs on
run g_off --backend cuda --prompt 512 --gen 128 --cuda-graphs off
run gemm_off --backend cuda --prompt 512 --gen 16 --cuda-gemm off
run kv16 --backend cuda --prompt 512 --gen 128 --kv f16
run long_on --backend cuda --prompt 4000 --gen 128 --cuda-graphs on
run long_off --backend cuda --prompt 4000 --gen 128 --cuda-graphs off
run cpu --backend cpu --prompt 512 --gen 128
timeout 20 $B --backend cuda --prompt 512 --gen 128 | tee "$OUT/bench_cuda.txt" | grep -E "decode|device memory|cuda "
