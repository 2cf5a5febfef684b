#!/usr/bin/env bash
# Device-side run for issue 10's CUDA pruned attention (helper G).
# Usage: h200-long.sh <carried binary folder> <model.gguf>
#   The folder holds bins.tar.xz with: kv_pruning_gpu (the test binary of
#   crates/mirage-cuda/tests/kv_pruning_gpu.rs), pruned-attention-bench and,
#   optionally, mirage-cli (all release, cuda feature, stripped).
# 1. GPU tests (MIRAGE_REQUIRE_CUDA_TESTS=1): device page boxes == host
#    min/max, every page selected == dense.cu full split-K attention, device
#    selection == the CPU rule with an f64 reference.
# 2. Attention-only decode time per token, full vs pruned, Qwen2.5-0.5B shape
#    (24 layers, 14 heads, 2 KV heads, d 64, f16 KV) at 4k/8k/16k/32k.
# 3. With mirage-cli and the model: full-model CUDA decode at 4k and 16k
#    prompt tokens (the backend itself does not prune yet), for scale.
# Budget: < 3 minutes. Short table last; logs under $OUT.
set -uo pipefail
BIN=${1:?carried binary folder}
MODEL=${2:-}
W=/tmp/g
OUT=${OUT:-/tmp/out}
mkdir -p "$W" "$OUT"
tar -xJf "$BIN/bins.tar.xz" -C "$W" || exit 1
NV=$(find /usr/local/cuda* /usr/local/lib /opt /usr/lib -name 'libnvrtc.so*' 2>/dev/null | grep -v stub | head -1)
export LD_LIBRARY_PATH="$(dirname "${NV:-/x/y}"):${LD_LIBRARY_PATH:-}"
export MIRAGE_CUDA_CACHE=$W/cache
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
echo "nvrtc: ${NV:-none}"

MIRAGE_REQUIRE_CUDA_TESTS=1 timeout 90 "$W/kv_pruning_gpu" --nocapture --test-threads 1 > "$OUT/kv_pruning_gpu.log" 2>&1
echo "kv_pruning_gpu rc=$?"
grep -E "^test |result:|panicked|CUDA device expected|differs|off the|changed nothing" "$OUT/kv_pruning_gpu.log" | head -24

# 16-position pages (the CPU fidelity runs' setting), then 64-position pages
# (4x fewer page boxes to bound, looser boxes).
timeout 50 "$W/pruned-attention-bench" --contexts 4096,8192,16384,32768 --iters 50 \
  --prune page=16,sinks=4,recent=8,top=32 --prune page=16,sinks=4,recent=8,top=32,top_percent=20 \
  > "$OUT/pruned_bench16.txt" 2>&1
echo "pruned-attention-bench page 16 rc=$?"
timeout 50 "$W/pruned-attention-bench" --contexts 4096,8192,16384,32768 --iters 50 \
  --prune page=64,sinks=1,recent=2,top=8 --prune page=64,sinks=1,recent=2,top=8,top_percent=20 \
  > "$OUT/pruned_bench64.txt" 2>&1
echo "pruned-attention-bench page 64 rc=$?"

if [ -x "$W/mirage-cli" ] && [ -n "$MODEL" ] && [ -f "$MODEL" ]; then
  for p in 4000 16000; do
    timeout 25 "$W/mirage-cli" bench --model "$MODEL" --backend cuda --prompt $p --gen 32 --kv f16 \
      > "$OUT/model_decode_$p.txt" 2>&1
    echo "model decode prompt=$p rc=$? $(grep -iE 'decode' "$OUT/model_decode_$p.txt" | head -2 | tr '\n' ' ')"
  done
fi
echo
echo "== pruned vs full decode attention (attention only, ms per token, all layers) =="
head -2 "$OUT/pruned_bench16.txt"
for f in "$OUT/pruned_bench16.txt" "$OUT/pruned_bench64.txt"; do
  sed -n '/^| context/,$p' "$f"
  grep -i "error\|panicked" "$f" | head -3
done
