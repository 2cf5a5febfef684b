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
device_unpack "$BIN" "$W" || exit 1
device_env "$W"
export MIRAGE_REQUIRE_CUDA_TESTS=1
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
[ -f "$BIN/COMMIT" ] && echo "bundle commit $(cat "$BIN/COMMIT")"
T0=$SECONDS
run() { # tag, timeout, cmd...
  local tag=$1 lim=$2 t=$SECONDS; shift 2
  timeout "$lim" "$@" > "$L/$tag.log" 2>&1
  local r=$?
  echo "== $tag rc=$r ($((SECONDS - t)) s) $(grep -E '^test result' "$L/$tag.log" | head -1)"
  return $r
}
run sparse_kernels 120 "$W/sparse_kernels" --nocapture --test-threads 1
grep -E "panicked|FAILED" "$L/sparse_kernels.log" | head -8
MIRAGE_SKIP_MODEL_TESTS=1 run sparse_backend 120 "$W/sparse_backend" --nocapture --test-threads 1
grep -E "panicked|FAILED|sizes|cosine" "$L/sparse_backend.log" | cut -c1-200 | head -10
run kv_toggle 60 "$W/kv_pruning_backend" pruning_toggled_on_one_cache_equals_dedicated_caches --nocapture
grep -E "panicked|cosine|err" "$L/kv_toggle.log" | cut -c1-200 | head -4
run kernel_bench 240 "$W/kernel-bench" --iters 30 --sparse
: > "$L/tables.txt"
bench() { # tag, timeout, args...
  local tag=$1 lim=$2; shift 2
  run "bench_$tag" "$lim" "$W/mirage-cli" bench --backend cuda "$@"
  { echo "== $tag: mirage-cli bench --backend cuda $*"; grep -vE '^\s*$|INFO|WARN' "$L/bench_$tag.log" | tail -14; } >> "$L/tables.txt"
}
if [ "$SHAPES" != none ]; then
  for s in $SHAPES; do
    f=$W/$s.gguf
    timeout 120 "$W/xtask" synth-model --like "$s" --quant q8_0 --out "$f" --tokenizer-from "$W/tok.gguf" > "$L/synth_$s.log" 2>&1
    echo "synth $s rc=$? ($(du -h "$f" 2>/dev/null | cut -f1))"
    for pf in q8_0 nvfp4; do
      bench "$s-$pf" 150 --model "$f" --synthetic-pages --page-format $pf --active 1.0,0.5,0.4,0.25 --prompt 16 --gen 66
    done
    rm -f "$f"
  done
fi
if [ -d target/bundle-vk ] && [ -d .gl ]; then
  OUT=$L/vk bash "$(dirname "$0")/h200-vkinterop.sh" target/bundle-vk > "$L/vk.txt" 2>&1
  echo "== vk interop rc=$? $(grep -c 'rc=0' "$L/vk.txt") steps ok"; grep -E 'rc=[1-9]' "$L/vk.txt" | head -5
fi
echo "total $((SECONDS - T0)) s"
tar -czf "$OUT/logs.tgz" -C "$L" . 2>/dev/null
echo; sed -n '/^== sparse FFN variants/,$p' "$L/kernel_bench.log" | head -40
echo; cat "$L/tables.txt"
[ -f "$L/vk/vk_tables.txt" ] && { echo; cat "$L/vk/vk_tables.txt"; }
