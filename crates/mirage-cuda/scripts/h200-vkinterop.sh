#!/usr/bin/env bash
# Device-side run of the CUDA–Vulkan interop router (issue #7 item 2): the
# Vulkan ray-tracing router fed and read by CUDA through exported memory and
# timeline semaphores, against route.cu and the CPU traversal, then timed.
#
# Build on the dev machine (release; the features are off by default):
#   bash crates/mirage-cuda/scripts/bundle-vkinterop.sh      # -> target/bundle-vk
# which runs
#   cargo build --release -p mirage-cuda --features vulkan-interop --bin vk-route-bench
#   cargo test  --release -p mirage-cuda --features vulkan-interop --test vk_interop --no-run
#   cargo test  --release -p mirage-route --features vulkan-rt --test vk_interop_export --no-run
# and copies them as BIN_DIR/{vk-route-bench,vk_interop,vk_interop_export}.
# Carry BIN_DIR and `.gl/` (the Vulkan loader .debs: the device has the
# NVIDIA driver's ICD but no libvulkan.so.1); this script unpacks `.gl` when
# it exists (dpkg -x to /, ldconfig).
#
# Usage: h200-vkinterop.sh BIN_DIR     (raw logs to $OUT, default /tmp/out)
# Tests run with MIRAGE_REQUIRE_CUDA_TESTS=1 and MIRAGE_REQUIRE_VK_RT=1, so a
# missing CUDA device or Vulkan RT/interop device fails instead of skipping.
set -uo pipefail
BIN=${1:?usage: h200-vkinterop.sh BIN_DIR}
BIN=$(cd "$BIN" && pwd)
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [ -d .gl ]; then
  for f in .gl/*.deb; do dpkg -x "$f" /; done
  ldconfig
fi
NV=$(find /usr/local/cuda* /usr/local/lib /opt /usr/lib -name 'libnvrtc.so*' 2>/dev/null | grep -v stub | head -1)
export LD_LIBRARY_PATH="$(dirname "${NV:-/x/y}"):${LD_LIBRARY_PATH:-}"
export MIRAGE_CUDA_CACHE=/tmp/vkinterop-cache
export MIRAGE_REQUIRE_CUDA_TESTS=1 MIRAGE_REQUIRE_VK_RT=1 MIRAGE_REQUIRE_VULKAN_RT=1
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
ls /usr/share/vulkan/icd.d /etc/vulkan/icd.d 2>/dev/null | tr '\n' ' '; echo
ldconfig -p | grep -c 'libvulkan.so.1' | sed 's/^/libvulkan.so.1 entries: /'
[ -f "$BIN/COMMIT" ] && echo "bundle commit $(cat "$BIN/COMMIT")"
rc=0
run() { # tag, timeout, cmd...
  local tag=$1 lim=$2; shift 2
  local t0; t0=$(date +%s)
  timeout "$lim" "$@" > "$OUT/$tag.log" 2>&1
  local r=$?
  echo "== $tag rc=$r ($(( $(date +%s) - t0 )) s)"
  [ $r -eq 0 ] || rc=1
  return $r
}
run vk_interop_export 60 "$BIN/vk_interop_export" --nocapture --test-threads 1
grep -E "^test |points|result:|panicked|skipped" "$OUT/vk_interop_export.log" | head -12
run vk_interop 120 "$BIN/vk_interop" --nocapture --test-threads 1
grep -E "^test |CUDA |queries equal|result:|panicked|skipped" "$OUT/vk_interop.log" | head -12
: > "$OUT/vk_tables.txt"
bench() { # tag, args...
  local tag=$1; shift
  if run "$tag" 240 "$BIN/vk-route-bench" "$@"; then
    { echo "# vk-route-bench $*"; sed -n '/^routing,/,$p' "$OUT/$tag.log"; echo; } >> "$OUT/vk_tables.txt"
  else
    tail -5 "$OUT/$tag.log"
  fi
}
# Qwen2.5-0.5B: 24 layers, 4864/128 = 38 pages, 4 slices, d_model 896;
# one Vulkan router (VkDevice) per layer, then one shared by all layers.
bench qwen05b --iters 200
bench qwen05b-1router --iters 200 --routers 1
# Qwen2.5-7B FFN pages (18944/128 = 148), 28 layers, d_model 3584.
bench qwen7b --layers 28 --pages 148 --d-model 3584 --iters 200
# route.cu walking the BVH instead of scanning the boxes (same lists).
bench qwen05b-bvh --iters 200 --bvh
echo; cat "$OUT/vk_tables.txt"
exit $rc
