#!/usr/bin/env bash
# One device call (issue #6): the mat-vec variants of the split Q8_0 / Q4_K
# layouts (MIRAGE_CUDA_MV=v1..v5; v1 = the default kernels), measured
# and checked, so that defaults can be picked from data. See ../NOTES.md
# ("Mat-vec variants").
#
#   h200-matvec.sh BIN_DIR
#
# BIN_DIR holds bins.tar.xz (or the files unpacked): mirage-cli, xtask,
# kernel-bench, the test binary fast_decode, tok.gguf (tokenizer-only GGUF
# for the synthetic models); release, stripped (NOTES.md says how it is
# built). Steps, < 5 min in all:
#   1. synth 7B Q8_0 and Q4_K written in the background (xtask synth-model);
#   2. kernel-bench --variants: every variant x split-K 1/2/4/8 on the 7B
#      shapes (QKV as one 3-matrix launch, O, down, lm head; gate+up as the
#      fused kernel), GB/s and share of a copy measured in the same run,
#      rel err of every variant vs v1 printed;
#   3. fast_decode tests (MIRAGE_REQUIRE_CUDA_TESTS=1), the variant tests
#      (every variant x split x layout vs f64 and v1; whole-model graph
#      decode vs v1) and the rest of the fast-path tests;
#   4. mirage-cli bench (prompt 32 + 64, graphs on) on both synthetic
#      models per variant (split-K by the rule); a second pass in the
#      opposite order for what fits before 270 s.
# Raw logs in $OUT; short tables printed last.
set -uo pipefail
BIN_DIR=${1:?usage: h200-matvec.sh BIN_DIR}
W=/tmp/mirage-mv
OUT=${OUT:-/tmp/out}
mkdir -p "$W" "$OUT"
T0=$(date +%s)
el() { echo "$(( $(date +%s) - T0 ))s"; }
. "$(dirname "$0")/common.sh"
device_unpack "$BIN_DIR" "$W" || exit 1
device_env "$W"
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
echo "nvrtc: ${NV:-none}; git $(git rev-parse --short HEAD 2>/dev/null) $(git status --short 2>/dev/null | wc -l) changed files"

# 1. Synthetic models in the background (CPU; the GPU steps run meanwhile).
(
  for q in q4_k q8_0; do
    timeout 120 "$W/xtask" synth-model --like qwen2.5-7b --quant $q --tokenizer-from "$W/tok.gguf" \
      --out "$W/synth-7b-$q.gguf" > "$OUT/synth-$q.log" 2>&1
    echo "synth $q rc=$? $(tail -1 "$OUT/synth-$q.log")" >> "$OUT/synth.txt"
  done
) &
SYN=$!

# 2. Kernel level (also compiles and caches the PTX for the steps after).
timeout 150 "$W/kernel-bench" --variants --iters 20 > "$OUT/kernel-bench.txt" 2>&1
echo "kernel-bench rc=$? at $(el)"

# 3. Tests.
export MIRAGE_SKIP_MODEL_TESTS=1
MIRAGE_REQUIRE_CUDA_TESTS=1 timeout 150 "$W/fast_decode" --test-threads 1 --nocapture > "$OUT/test_fast_decode.log" 2>&1
echo "fast_decode rc=$? $(grep -E '^test result:' "$OUT/test_fast_decode.log" | tail -1) at $(el)"
grep -E "panicked|FAILED|failed" "$OUT/test_fast_decode.log" | head -8
grep -E "mat-vec variants|v[234]: vs v1 worst" "$OUT/test_fast_decode.log" | head -24

# 4. Model benches per variant.
while kill -0 $SYN 2>/dev/null && [ $(( $(date +%s) - T0 )) -lt 240 ]; do sleep 2; done
cat "$OUT/synth.txt" 2>/dev/null; echo "synth done at $(el)"
field() { grep -o "\"$2\":[^,}]*" "$1" | head -1 | cut -d: -f2 | tr -d '"'; }
ROWS=()
for pass in 1 2; do
  order="1 2 3 4 5"; [ $pass = 2 ] && order="5 4 3 2 1"
  for q in q8_0 q4_k; do
    M=$W/synth-7b-$q.gguf
    [ -f "$M" ] || { echo "no $M"; continue; }
    for v in $order; do
      [ $pass = 2 ] && [ $(( $(date +%s) - T0 )) -gt 270 ] && { echo "time budget: skipping $q v$v pass 2"; continue; }
      j="$OUT/bench_7b_${q}_v${v}_p$pass.json"
      MIRAGE_CUDA_MV=v$v timeout 45 "$W/mirage-cli" bench --model "$M" --backend cuda --prompt 32 --gen 64 --json > "$j" 2> "${j%.json}.err"
      rc=$?
      ROWS+=("$(printf '%-10s %-3s %-5s rc=%-3s %9s %9s %8s %8s' "7b-$q" "v$v" "p$pass" "$rc" \
        "$(field "$j" decode_tok_s)" "$(field "$j" decode_ms_median)" "$(field "$j" achieved_gb_s)" "$(field "$j" copy_gb_s)")")
    done
  done
done
echo "benches done at $(el)"

echo
echo "===== kernel level (kernel-bench --variants; full table in $OUT/kernel-bench.txt)"
grep -E "^copy|^device" "$OUT/kernel-bench.txt"
awk '/best per shape/,0' "$OUT/kernel-bench.txt"
echo
echo "===== decode, synth 7B (prompt 32 + 64, graphs on, split-K rule); llama.cpp 2026-12-03: q8_0 225.5, q4_k 268.1 tok/s"
printf '%-10s %-3s %-5s %-6s %9s %9s %8s %8s\n' model mv pass rc tok/s med_ms GB/s copyGB/s
for r in "${ROWS[@]}"; do echo "$r"; done
