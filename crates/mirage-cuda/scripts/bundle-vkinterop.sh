#!/usr/bin/env bash
# Builds the binaries of h200-vkinterop.sh (on the dev machine, no GPU and no
# ray-tracing device needed) into $OUTDIR (default target/bundle-vk), release,
# stripped:
#   vk-route-bench     cargo build --release -p mirage-cuda --features vulkan-interop --bin vk-route-bench
#   vk_interop         cargo test  --release -p mirage-cuda --features vulkan-interop --test vk_interop --no-run
#   vk_interop_export  cargo test  --release -p mirage-route --features vulkan-rt --test vk_interop_export --no-run
#   mirage-cli-vk      cargo build --release -p mirage-cli --features vulkan-interop (bench --routed --vulkan-router)
# (`vulkan-interop` enables mirage-route/vulkan-rt; both are off by default.)
# Carry $OUTDIR (about 10 MB) and the `.gl/` folder of Vulkan loader .debs,
# then on the device: bash crates/mirage-cuda/scripts/h200-vkinterop.sh target/bundle-vk
set -euo pipefail
cd "$(dirname "$0")/../../.."
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target/cuda}
OUTDIR=${OUTDIR:-target/bundle-vk}
nice cargo build --release -p mirage-cuda --features vulkan-interop --bin vk-route-bench
nice cargo build --release -p mirage-cli --features vulkan-interop
. crates/mirage-cuda/scripts/common.sh
exe() { test_executables "$@" | cut -d' ' -f2 | tail -1; }
T1=$(exe -p mirage-cuda --features vulkan-interop --test vk_interop)
T2=$(exe -p mirage-route --features vulkan-rt --test vk_interop_export)
[ -n "$T1" ] && [ -n "$T2" ] || { echo "test binaries not found" >&2; exit 1; }
mkdir -p "$OUTDIR"
cp "$CARGO_TARGET_DIR/release/vk-route-bench" "$OUTDIR/"
cp "$CARGO_TARGET_DIR/release/mirage-cli" "$OUTDIR/mirage-cli-vk"
cp "$T1" "$OUTDIR/vk_interop"
cp "$T2" "$OUTDIR/vk_interop_export"
strip "$OUTDIR/vk-route-bench" "$OUTDIR/vk_interop" "$OUTDIR/vk_interop_export" "$OUTDIR/mirage-cli-vk"
git rev-parse --short HEAD > "$OUTDIR/COMMIT"
ls -la "$OUTDIR"
