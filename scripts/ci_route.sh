#!/usr/bin/env bash
# CI steps of crates/mirage-route: install Mesa's lavapipe Vulkan driver and
# glslc, check that the committed SPIR-V is fresh, and run the router tests
# with the wgpu path for real (MIRAGE_REQUIRE_GPU_TESTS=1: no adapter = fail).
# The Vulkan RT path has no device on lavapipe; its test prints the typed
# reason it skips. Called from .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v glslc >/dev/null || ! ls /usr/share/vulkan/icd.d/lvp_icd*.json >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get -o DPkg::Lock::Timeout=600 update -qq
    apt-get -o DPkg::Lock::Timeout=600 install -y -qq mesa-vulkan-drivers libvulkan1 glslc vulkan-tools >/dev/null
fi
# lavapipe's WSI wants a runtime dir even for headless compute.
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-$(mktemp -d)}"
vulkaninfo --summary 2>/dev/null | grep -E 'deviceName|deviceType' || true

echo "== SPIR-V freshness (cargo xtask shaders --check)"
if grep -q 'Shaders' xtask/src/main.rs; then
    cargo xtask shaders --check
else
    # xtask not wired yet: compile and compare directly.
    for src in shaders/*.rgen shaders/*.rint shaders/*.rmiss shaders/*.comp; do
        name=$(basename "$src")
        tmp=$(mktemp)
        (cd shaders && glslc --target-env=vulkan1.2 -O -o "$tmp" "$name")
        cmp -s "$tmp" "shaders/$name.spv" || { echo "STALE shaders/$name.spv: run cargo xtask shaders"; exit 1; }
        rm -f "$tmp"
    done
fi

echo "== mirage-route tests (wgpu on lavapipe, required)"
MIRAGE_REQUIRE_GPU_TESTS=1 cargo test -p mirage-route --features wgpu,vulkan-rt
