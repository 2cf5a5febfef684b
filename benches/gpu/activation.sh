#!/usr/bin/env bash
# Activation-sparse CUDA decode on a GPU machine (no Rust, no network), from
# a bundle made by benches/gpu/bundle.sh:
#
#   benches/gpu/activation.sh BUNDLE_DIR
#
# 1. the GPU suite `activation_backend` (the CUDA sparse decode against the
#    CPU activation backend on small random models; every channel kept
#    against the dense CUDA path), with its pass and fail counts;
# 2. per synthetic Qwen2.5 shape (SHAPES, default 0.5B and 7B) and weight
#    type (QUANTS, default q8_0 and q4_k), written on the device by the
#    bundle's `xtask synth-model`: an activation artifact built by
#    `xtask build-artifacts --mode activation --statistics-only` (the
#    projections repacked channel-major; thresholds from the input
#    statistics of 32 calibration tokens of generated text: random weights,
#    so speed only, fidelity means nothing), then
#    `mirage-cli bench --backend cuda --sparsity 0.25,0.4,0.5`: dense and
#    sparse decode tok/s of the same loaded model in one run, alternating
#    over ROUNDS rounds, and one decode step per configuration profiled op
#    by op (the mat-vecs' share of the copy bandwidth for the bytes read);
# then one table. Each step runs under `timeout`; no step starts once
# BUDGET seconds (default 330) have passed. Environment: WORK (default
# /tmp/mirage-act; about 16 GB free for the 7B Q8_0 model and its
# artifact), SHAPES, QUANTS, BUDGET, GEN (decode tokens, default 64),
# ROUNDS (default 3).
set -uo pipefail
BUNDLE=$(cd "${1:?usage: activation.sh BUNDLE_DIR}" && pwd)
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/lib.sh"
WORK=${WORK:-/tmp/mirage-act}
SHAPES=${SHAPES:-qwen2.5-0.5b qwen2.5-7b}
QUANTS=${QUANTS:-q4_k q8_0}
BUDGET=${BUDGET:-330}
GEN=${GEN:-64}
ROUNDS=${ROUNDS:-3}
LOG=$WORK/log
W=$WORK/bin
mkdir -p "$LOG"
: > "$LOG/suites.txt"
: > "$LOG/rows.txt"
T0=$SECONDS
gpu_unpack "$BUNDLE" "$W" || exit 1
gpu_env "$W"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader

SUITE_LIMIT=120 suite act "$W" activation_backend

# Calibration text: any text the tokenizer turns into tokens will do.
seq 1 4000 | tr '\n' ' ' > "$WORK/calib.txt"
for shape in $SHAPES; do
  for q in $QUANTS; do
    budget_left "$shape $q" || break 2
    f=$WORK/$shape-$q.gguf
    a=$WORK/$shape-$q.activation.mirage
    step "synth-$shape-$q" 120 "$W/xtask" synth-model --like "$shape" --quant "$q" \
      --tokenizer-from "$W/tok.gguf" --out "$f" || { rm -f "$f"; continue; }
    step "artifact-$shape-$q" 180 "$W/xtask" build-artifacts --mode activation --statistics-only \
      --model "$f" --calib "$WORK/calib.txt" --calib-tokens 32 --out "$a" || { rm -f "$f" "$a"; continue; }
    step "bench-$shape-$q" 180 "$W/mirage-cli" bench --backend cuda --model "$f" --artifact "$a" \
      --sparsity 0.25,0.4,0.5 --sparsity-plan teal/uniform --sparsity-text "$WORK/calib.txt" \
      --prompt 16 --gen "$GEN" --rounds "$ROUNDS"
    # The bench's table rows: config, tok/s, x dense, MiB/token, GB/s, % copy bw, skipped, mv us, mv % copy.
    awk -v m="$shape $q" '/^(dense|teal)/ { n = NF; printf "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", m, ($1 == "dense" ? "dense" : $(n-8)), $(n-7), $(n-6), $(n-5), $(n-3), $(n-2), $n }' \
      "$LOG/bench-$shape-$q.log" >> "$LOG/rows.txt"
    grep -E '^model ' "$LOG/bench-$shape-$q.log" | head -1
    rm -f "$f" "$a"
  done
done

echo
echo "## GPU suite (bundle $(cat "$BUNDLE/COMMIT" 2>/dev/null || echo '?'))"
printf '%-20s %7s %7s %7s\n' suite passed failed seconds
while read -r _ name p f s; do printf '%-20s %7s %7s %7s\n' "$name" "$p" "$f" "$s"; done < "$LOG/suites.txt"
echo
echo "## activation-sparse decode (mirage-cli bench --backend cuda --sparsity 0.25,0.4,0.5, plan teal/uniform)"
printf '%-18s %-8s %10s %8s %10s %10s %9s %10s\n' model sparsity "tok/s" "x dense" "MiB/tok" "% copy bw" skipped "mv % copy"
while IFS=$'\t' read -r m c t x b p s v; do printf '%-18s %-8s %10s %8s %10s %10s %9s %10s\n' "$m" "$c" "$t" "$x" "$b" "$p" "$s" "$v"; done < "$LOG/rows.txt"
echo
echo "total $((SECONDS - T0)) s; logs in $LOG"
