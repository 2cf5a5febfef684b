#!/usr/bin/env bash
# Activation-sparse CUDA FFN decode on a GPU machine (no Rust, no network),
# from a bundle made by benches/gpu/bundle.sh:
#
#   benches/gpu/activation.sh BUNDLE_DIR
#
# 1. The GPU suite `activation_backend` (the sparse CUDA FFN decode
#    against the CPU activation backend on small random models of every
#    FFN type the kernels read; every channel kept against the dense CUDA
#    path; a type the kernels do not read and an artifact of another
#    model refused) with
#    MIRAGE_REQUIRE_CUDA_TESTS=1, its log showing each test's worst cosine
#    and the FFN bytes of its last decode row.
# 2. Per synthetic Qwen2.5-7B file (MODELS, default Q8_0 and Q4_K), written
#    on the machine by the bundle's `xtask synth-model` while the suite
#    runs: an activation artifact from `xtask build-artifacts --mode
#    activation --statistics-only` (thresholds from the input statistics of
#    32 tokens of generated text: random weights, so speed only), then
#    `mirage-cli bench --backend cuda --sparsity SPARSITIES` (dense and
#    sparse decode of one loaded model, alternating over ROUNDS rounds; the
#    FFN bytes read per token and the share of its input channels kept,
#    measured from the kernels' channel lists).
# Then one table. Each step runs under `timeout`, cut to what is left of
# DEADLINE seconds (default 470) since the start. Environment: WORK
# (default /tmp/mirage-act; about 17 GB free for the 7B Q8_0 file and its
# artifact), MODELS (shape:quant ...), SPARSITIES (default 0,0.25,0.5),
# GEN (decode tokens, default 64), ROUNDS (default 3), DEADLINE.
set -uo pipefail
BUNDLE=$(cd "${1:?usage: activation.sh BUNDLE_DIR}" && pwd)
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/lib.sh"
WORK=${WORK:-/tmp/mirage-act}
MODELS=${MODELS:-qwen2.5-7b:q8_0 qwen2.5-7b:q4_k}
SPARSITIES=${SPARSITIES:-0,0.25,0.5}
GEN=${GEN:-64}
ROUNDS=${ROUNDS:-3}
DEADLINE=${DEADLINE:-470}
BUDGET=$((DEADLINE - 60))
gpu_start

for b in activation_backend xtask mirage-cli tok.gguf; do
  [ -e "$W/$b" ] || { echo "no $b in the bundle"; exit 1; }
done
# The CPU writes the 7B files while the GPU runs the suite.
synth_models
SUITE_LIMIT=180 suite act "$W" activation_backend
grep -hE "worst step cosine|skipped" "$LOG"/act-activation_backend*.log 2>/dev/null

# Seconds a step may take: at most $1, and what is left of DEADLINE.
limit() {
  local left=$((DEADLINE - (SECONDS - T0)))
  [ "$left" -lt "$1" ] && echo "$left" || echo "$1"
}
# Calibration text: any text the tokenizer turns into tokens will do.
seq 1 4000 | tr '\n' ' ' > "$WORK/calib.txt"
for m in $MODELS; do
  shape=${m%:*} q=${m#*:}
  f=$WORK/$shape-$q.gguf
  a=$WORK/$shape-$q.activation.mirage
  budget_left "$shape $q" || break
  wait_file "$f" || { echo "no $f (see $LOG/synth-$shape-$q.log)"; continue; }
  step "artifact-$shape-$q" "$(limit 200)" "$W/xtask" build-artifacts --mode activation --statistics-only \
    --model "$f" --calib "$WORK/calib.txt" --calib-tokens 32 --out "$a" || { rm -f "$f" "$a"; continue; }
  budget_left "bench $shape $q" || { rm -f "$f" "$a"; break; }
  step "bench-$shape-$q" "$(limit 150)" "$W/mirage-cli" bench --backend cuda --model "$f" --artifact "$a" \
    --sparsity "$SPARSITIES" --sparsity-plan teal/uniform --sparsity-text "$WORK/calib.txt" \
    --prompt 16 --gen "$GEN" --rounds "$ROUNDS"
  grep -E "^(model|error)" "$LOG/bench-$shape-$q.log" | head -2
  # Table rows: config, tok/s, x dense, FFN MiB/tok, x FFN, kept, MiB/token, GB/s.
  awk -v m="$shape $q" '/^(dense|sparse) / {
      printf "%s\t%s\t%s\t%s\t%s\t%s\t%s\n", m, ($1 == "dense" ? "dense" : $2), $(NF-6), $(NF-5), $(NF-4), $(NF-2), $(NF-1)
    }' "$LOG/bench-$shape-$q.log" >> "$LOG/rows.txt"
  rm -f "$f" "$a"
done
# A file still being written when the deadline came: stop its writer.
pkill -P "$SYNTH" 2>/dev/null; kill "$SYNTH" 2>/dev/null

echo
echo "## GPU suite (bundle $(cat "$BUNDLE/COMMIT" 2>/dev/null || echo '?'))"
printf '%-20s %7s %7s %7s\n' suite passed failed seconds
while read -r _ name p f s; do printf '%-20s %7s %7s %7s\n' "$name" "$p" "$f" "$s"; done < "$LOG/suites.txt"
echo
echo "## activation-sparse CUDA decode (mirage-cli bench --backend cuda --sparsity $SPARSITIES, plan teal/uniform, $GEN tokens, $ROUNDS rounds; only gate/up/down sparse)"
printf '%-16s %-9s %9s %8s %12s %7s %10s\n' model sparsity "tok/s" "x dense" "FFN MB/tok" kept "MiB/tok"
while IFS=$'\t' read -r m c t x ffn k tot; do
  printf '%-16s %-9s %9s %8s %12s %7s %10s\n' "$m" "$c" "$t" "$x" "$(awk -v v="$ffn" 'BEGIN { printf "%.1f", v * 1.048576 }')" "$k" "$tot"
done < "$LOG/rows.txt"
echo "total $((SECONDS - T0)) s; logs in $LOG"
