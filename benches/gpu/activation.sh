#!/usr/bin/env bash
# Activation-sparse CUDA FFN decode on a GPU machine (no Rust, no network),
# from a bundle made by benches/gpu/bundle.sh:
#
#   benches/gpu/activation.sh BUNDLE_DIR
#
# Runs the GPU suite `activation_backend` (the sparse CUDA FFN decode
# against the CPU activation backend on small random Q8_0 and Q4_K models;
# every channel kept against the dense CUDA path; a type the kernels do not
# read and an artifact of another model refused) with
# MIRAGE_REQUIRE_CUDA_TESTS=1, its log showing each test's worst cosine and
# the FFN bytes of its last decode row, then one table of pass and fail
# counts. Environment: WORK (default /tmp/mirage-act).
set -uo pipefail
BUNDLE=$(cd "${1:?usage: activation.sh BUNDLE_DIR}" && pwd)
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/lib.sh"
WORK=${WORK:-/tmp/mirage-act}
LOG=$WORK/log
W=$WORK/bin
mkdir -p "$LOG"
: > "$LOG/suites.txt"
T0=$SECONDS
gpu_unpack "$BUNDLE" "$W" || exit 1
gpu_env "$W"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader

[ -x "$W/activation_backend" ] || { echo "no activation_backend test binary in the bundle"; exit 1; }
SUITE_LIMIT=180 suite act "$W" activation_backend
grep -hE "worst step cosine|skipped" "$LOG"/act-activation_backend*.log 2>/dev/null

echo
echo "## GPU suite (bundle $(cat "$BUNDLE/COMMIT" 2>/dev/null || echo '?'))"
printf '%-20s %7s %7s %7s\n' suite passed failed seconds
while read -r _ name p f s; do printf '%-20s %7s %7s %7s\n' "$name" "$p" "$f" "$s"; done < "$LOG/suites.txt"
echo "total $((SECONDS - T0)) s; logs in $LOG"
