#!/usr/bin/env bash
# Device-side run for the sparse (superblock) CUDA backend, issue #7.
# Carried: .devbin-e/bins.tar.xz (release, stripped: mirage-cli, xtask, the
# `sparse_backend` and `sparse_kernels` test binaries, and
# qwen-tokenizer.gguf = `xtask synth-model --tokenizer-only`), and
# .devbin-e/smol4.gguf (SmolLM2-135M Q4_1 cut to its first 4 blocks by
# scripts/truncate_gguf_blocks.py) + .devbin-e/smol4.mirage (`xtask
# build-artifacts --model smol4.gguf --max-tokens 256`, GPL-3 calibration).
#
# Usage: h200-sparse.sh [SHAPES] [MODEL ARTIFACT]
#   SHAPES  synthetic Qwen2.5 shapes to bench with --synthetic-pages, written
#           on the device by `xtask synth-model --quant q8_0` (default
#           "qwen2.5-1.5b qwen2.5-7b"; "none" to skip).
#   MODEL ARTIFACT  a real GGUF and its .mirage artifact (default: the
#           carried smol4 pair when present): the routed-vs-CPU-superblock
#           greedy test runs on them, and a bench with forced fractions and
#           --routed.
# GPU tests run first (MIRAGE_REQUIRE_CUDA_TESTS=1), then the benches; the
# table is printed last, raw logs go to $OUT.
set -uo pipefail
SHAPES=${1:-"qwen2.5-1.5b qwen2.5-7b"}
MODEL=${2:-}
ARTIFACT=${3:-}
if [ -z "$MODEL" ] && [ -f .devbin-e/smol4.gguf ] && [ -f .devbin-e/smol4.mirage ]; then
  MODEL=.devbin-e/smol4.gguf ARTIFACT=.devbin-e/smol4.mirage
fi
if [ -n "$MODEL" ]; then export MIRAGE_SPARSE_MODEL=$MODEL MIRAGE_SPARSE_ARTIFACT=$ARTIFACT; else export MIRAGE_SKIP_MODEL_TESTS=1; fi
W=/tmp/e
OUT=${OUT:-/tmp/out}
mkdir -p "$W" "$OUT"
tar -xJf .devbin-e/bins.tar.xz -C "$W" || exit 1
NV=$(find /usr/local/cuda* /usr/local/lib /opt /usr/lib -name 'libnvrtc.so*' 2>/dev/null | grep -v stub | head -1)
export LD_LIBRARY_PATH="$(dirname "${NV:-/x/y}"):${LD_LIBRARY_PATH:-}"
export MIRAGE_CUDA_CACHE=$W/cache
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
t0=$(date +%s)
MIRAGE_REQUIRE_CUDA_TESTS=1 timeout 60 "$W/sparse_backend_test" --nocapture --test-threads 1 > "$OUT/sparse_backend.log" 2>&1
echo "sparse_backend tests rc=$? ($(( $(date +%s) - t0 )) s)"
grep -E "^test |cosine|sizes|differed|graph stats|result:|panicked|skipped" "$OUT/sparse_backend.log" | head -30
MIRAGE_REQUIRE_CUDA_TESTS=1 timeout 40 "$W/sparse_kernels_test" --nocapture --test-threads 1 > "$OUT/sparse_kernels.log" 2>&1
echo "sparse_kernels tests rc=$?"
grep -E "^test |result:|panicked" "$OUT/sparse_kernels.log" | head -12
: > "$OUT/tables.txt"
bench() { # tag, timeout, args...
  local tag=$1 lim=$2; shift 2
  local t=$(date +%s)
  timeout "$lim" "$W/mirage-cli" bench --backend cuda "$@" > "$OUT/bench_$tag.txt" 2> "$OUT/bench_$tag.err"
  local rc=$?
  echo "bench $tag rc=$rc ($(( $(date +%s) - t )) s)"; tail -3 "$OUT/bench_$tag.err"
  { echo "== $tag: mirage-cli bench --backend cuda $*"; cat "$OUT/bench_$tag.txt"; } >> "$OUT/tables.txt"
}
if [ "$SHAPES" != none ]; then
  for s in $SHAPES; do
    t=$(date +%s)
    timeout 90 "$W/xtask" synth-model --like "$s" --quant q8_0 --out "$W/$s.gguf" --tokenizer-from "$W/qwen-tokenizer.gguf" > "$OUT/synth_$s.log" 2>&1
    echo "synth $s rc=$? ($(( $(date +%s) - t )) s, $(du -h "$W/$s.gguf" 2>/dev/null | cut -f1))"
    bench "$s" 120 --model "$W/$s.gguf" --synthetic-pages --active 1.0,0.75,0.5,0.4,0.35,0.25 --prompt 16 --gen 66
    rm -f "$W/$s.gguf"
  done
fi
if [ -n "$MODEL" ] && [ -n "$ARTIFACT" ]; then
  bench real 90 --model "$MODEL" --artifact "$ARTIFACT" --routed --active 1.0,0.75,0.5,0.35,0.25 --prompt 16 --gen 130
fi
echo "total $(( $(date +%s) - t0 )) s"
cat "$OUT/tables.txt"
