#!/usr/bin/env bash
# The GPU benchmark, on any machine with an NVIDIA GPU, its driver and the
# CUDA toolkit's libnvrtc (no Rust, no network):
#
#   benches/gpu/run.sh BUNDLE_DIR [LLAMA_SRC.tar.xz]
#
# BUNDLE_DIR is what benches/gpu/bundle.sh made. In order, each step under a
# time limit, no step starting once BUDGET seconds have passed:
#   1. the mirage-cuda GPU suites (kernels, fast_decode, sparse_backend,
#      kv_pruning_gpu, kv_pruning_backend, sparse_pages, real_models; a
#      missing GPU fails them, the real-model tests skip without models/),
#      with their pass and fail counts;
#   2. per synthetic Qwen2.5 shape (SHAPES, default 0.5B and 7B) and weight
#      type (QUANTS, default q8_0 and q4_k), written on the device by the
#      bundle's `xtask synth-model`: `mirage-cli bench --backend cuda`
#      (prompt 512, 128 decoded tokens): prompt and decode tok/s; with a
#      llama.cpp source tarball (benches/gpu_peer.sh pack), llama-bench on
#      the same file (benches/gpu_peer.sh compare);
#   3. the 7B Q8_0 shape's sparse rows: `mirage-cli bench --synthetic-pages`
#      (Q8_0 pages from the model's own FFN, 100 / 50 / 25 % of the pages
#      forced, beside the dense row);
# then one table. Environment: WORK (default /tmp/mirage-gpu; about 9 GB
# free for the 7B Q8_0 file), SHAPES, QUANTS, BUDGET (default 1500).
set -uo pipefail
BUNDLE=$(cd "${1:?usage: run.sh BUNDLE_DIR [LLAMA_SRC.tar.xz]}" && pwd)
PEER_SRC=${2:-}
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/lib.sh"
WORK=${WORK:-/tmp/mirage-gpu}
SHAPES=${SHAPES:-qwen2.5-0.5b qwen2.5-7b}
QUANTS=${QUANTS:-q8_0 q4_k}
BUDGET=${BUDGET:-1500}
gpu_start

for s in $GPU_SUITES; do
  budget_left "suite $s" && suite run "$W" "$s"
done

LB=
if [ -n "$PEER_SRC" ] && budget_left "llama.cpp build"; then
  step peer_build 900 bash "$HERE/../gpu_peer.sh" build "$PEER_SRC" "$WORK/llama" && LB=$WORK/llama/build/bin/llama-bench
fi

for shape in $SHAPES; do
  for q in $QUANTS; do
    budget_left "$shape $q" || break 2
    f=$WORK/$shape-$q.gguf
    step "synth-$shape-$q" 300 "$W/xtask" synth-model --like "$shape" --quant "$q" --tokenizer-from "$W/tok.gguf" --out "$f" || continue
    step "dense-$shape-$q" 300 "$W/mirage-cli" bench --backend cuda --model "$f" --prompt 512 --gen 128 --json
    bench_rows "$shape $q" "$LOG/dense-$shape-$q.log" >> "$LOG/rows.txt"
    if [ "$shape" = qwen2.5-7b ] && [ "$q" = q8_0 ] && budget_left "7B sparse rows"; then
      step "sparse-$shape-$q" 400 "$W/mirage-cli" bench --backend cuda --model "$f" --synthetic-pages \
        --page-format q8_0 --active 1.0,0.5,0.25 --prefix-dense off --prompt 16 --gen 66
      bench_rows "$shape $q" "$LOG/sparse-$shape-$q.log" | grep -v $'\tdense\t' >> "$LOG/rows.txt"
    fi
    if [ -n "$LB" ] && budget_left "llama.cpp on $shape $q"; then
      PEER_OUT=$LOG/peer step "peer-$shape-$q" 300 bash "$HERE/../gpu_peer.sh" compare "$LB" "$W/mirage-cli" "$f"
      grep '^|' "$LOG/peer-$shape-$q.log" | tail -1 >> "$LOG/peer.txt"
    fi
    rm -f "$f"
  done
done

echo
echo "## GPU suites (bundle $(cat "$BUNDLE/COMMIT" 2>/dev/null || echo '?'))"
printf '%-20s %7s %7s %7s\n' suite passed failed seconds
while read -r _ name p f s; do printf '%-20s %7s %7s %7s\n' "$name" "$p" "$f" "$s"; done < "$LOG/suites.txt"
echo
echo "## decode and prompt speed (mirage-cli bench --backend cuda)"
printf '%-22s %-24s %12s %12s\n' model row "decode tok/s" "prompt tok/s"
while IFS=$'\t' read -r m r d p; do printf '%-22s %-24s %12s %12s\n' "$m" "$r" "$d" "$p"; done < "$LOG/rows.txt"
if [ -s "$LOG/peer.txt" ]; then
  echo
  echo "## against llama.cpp (llama-bench -p 512 -n 128)"
  echo "| model | MIRAGE pp512 tok/s | llama.cpp pp512 tok/s | ratio | MIRAGE tg128 tok/s | llama.cpp tg128 tok/s | ratio |"
  echo "|---|---:|---:|---:|---:|---:|---:|"
  cat "$LOG/peer.txt"
fi
echo
echo "total $((SECONDS - T0)) s; logs in $LOG"
