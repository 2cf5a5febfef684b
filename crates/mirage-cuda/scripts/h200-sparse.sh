#!/usr/bin/env bash
# Device-side run of the sparse (superblock) CUDA backend, issue #7, on
# synthetic shapes (the real Qwen artifact runs through h200-qwen.sh's
# `sparse` stage, which needs the model carried in pieces).
#
# Build here: bash crates/mirage-cuda/scripts/bundle.sh   (-> target/bundle)
# Then on the device, carrying target/bundle (and target/bundle-vk + .gl for
# the Vulkan interop part, built by bundle-vkinterop.sh; skipped when absent):
#   bash crates/mirage-cuda/scripts/h200-sparse.sh target/bundle [SHAPES]
# SHAPES: synthetic Qwen2.5 shapes (`xtask synth-model --like S --quant
# q8_0`, written on the device) benched with --synthetic-pages at forced
# fractions in Q8_0 and NVFP4 pages; default "qwen2.5-7b"; "none" skips.
# Order: GPU tests (MIRAGE_REQUIRE_CUDA_TESTS=1: a missing GPU fails), the
# kernel-level sparse tables, the decode benches, the interop part; short
# tables last, raw logs in $OUT.
set -uo pipefail
BIN=${1:?usage: h200-sparse.sh BIN_DIR [SHAPES]}
SHAPES=${2:-qwen2.5-7b}
W=/tmp/sp
OUT=${OUT:-/tmp/out}
L=$W/log
mkdir -p "$W" "$L" "$OUT"
. "$(dirname "$0")/common.sh"
device_start "$BIN" "$W" || exit 1
export MIRAGE_REQUIRE_CUDA_TESTS=1
BUDGET=${BUDGET:-540}  # seconds: no new step starts after this (the call's limit is 600)
MIRAGE_SKIP_MODEL_TESTS=1 run sparse_backend 150 "$W/sparse_backend" --nocapture --test-threads 1
grep -E "panicked|FAILED|sizes|cosine" "$L/sparse_backend.log" | cut -c1-200 | head -10
run sparse_kernels 150 "$W/sparse_kernels" --nocapture --test-threads 1
grep -E "panicked|FAILED" "$L/sparse_kernels.log" | head -8
[ "${KERNEL_BENCH:-1}" = 1 ] && run kernel_bench 120 "$W/kernel-bench" --iters 30 --sparse
: > "$L/tables.txt"
bench() { # tag, timeout, args...
  local tag=$1 lim=$2; shift 2
  run "bench_$tag" "$lim" "$W/mirage-cli" bench --backend cuda "$@"
  { echo "== $tag: mirage-cli bench --backend cuda $*"; grep -vE '^\s*$|INFO|WARN' "$L/bench_$tag.log" | tail -14; } >> "$L/tables.txt"
}
run kv_toggle 60 "$W/kv_pruning_backend" pruning_toggled_on_one_cache_equals_dedicated_caches --nocapture
grep -E "panicked|cosine|err" "$L/kv_toggle.log" | cut -c1-200 | head -4
if [ -d target/bundle-vk ] && [ -d .gl ] && left "vk interop"; then
  # The interop tests (route.cu, the interop path and the CPU give equal
  # lists) and route.cu's cost at the 0.5B / 7B router shapes, scan and walk
  # (h200-vkinterop.sh runs the full interop table).
  for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
  V=target/bundle-vk
  MIRAGE_REQUIRE_VK_RT=1 run vk_interop 120 "$V/vk_interop" --nocapture --test-threads 1
  grep -E "panicked|queries equal" "$L/vk_interop.log" | head -4
  for a in "" "--layers 28 --pages 148 --d-model 3584" "--bvh"; do
    left "vk-route-bench $a" || break
    run vkrb 90 "$V/vk-route-bench" --iters 100 --routers 1 $a
    { echo "# vk-route-bench --iters 100 --routers 1 $a"; sed -n '/^routing,/,$p' "$L/vkrb.log"; } >> "$L/vk_tables.txt"
  done
fi
if [ "$SHAPES" != none ]; then
  for s in $SHAPES; do
    left "synth $s" || break
    f=$W/$s.gguf
    timeout 120 "$W/xtask" synth-model --like "$s" --quant q8_0 --out "$f" --tokenizer-from "$W/tok.gguf" > "$L/synth_$s.log" 2>&1
    echo "synth $s rc=$? ($(du -h "$f" 2>/dev/null | cut -f1))"
    for pf in ${PAGE_FORMATS:-q8_0 nvfp4 q2_k}; do
      left "bench $s $pf" || break
      bench "$s-$pf" $((BUDGET + 50 - (SECONDS - T0))) --model "$f" --synthetic-pages --page-format $pf \
        --active 1.0,0.5,0.4,0.25 --prompt 16 --gen 66
    done
    rm -f "$f"
  done
fi
echo "total $((SECONDS - T0)) s"
tar -czf "$OUT/logs.tgz" -C "$L" . 2>/dev/null
echo; sed -n '/^## sparse/,$p' "$L/kernel_bench.log" | head -60
echo; cat "$L/tables.txt"
[ -f "$L/vk_tables.txt" ] && { echo; cat "$L/vk_tables.txt"; }
