#!/usr/bin/env bash
# Builds the GPU benchmark bundle on a machine with Rust (no GPU needed):
# OUT_DIR/bins.tar.xz (default target/bundle) with mirage-cli (cuda
# feature), xtask (for `synth-model`), every mirage-cuda test binary under
# its test name (kernels, fast_decode, sparse_backend, ...), all release and
# stripped, and tok.gguf (a Qwen2.5 tokenizer alone, `xtask synth-model
# --tokenizer-only`, for the synthetic models), plus OUT_DIR/COMMIT. About
# 10 MiB. Carry OUT_DIR to the GPU machine and run benches/gpu/run.sh there.
#
#   benches/gpu/bundle.sh [OUT_DIR]
#
# TOKENIZER_FROM: the Qwen2.5 GGUF whose tokenizer is copied (default the
# one `cargo xtask fetch-models` fetches).
set -euo pipefail
cd "$(dirname "$0")/../.."
. benches/gpu/lib.sh
OUT=${1:-target/bundle}
TOK_FROM=${TOKENIZER_FROM:-models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf}
[ -f "$TOK_FROM" ] || { echo "no $TOK_FROM: run cargo xtask fetch-models or set TOKENIZER_FROM" >&2; exit 1; }
nice cargo build --release -p mirage-cli -p xtask --bins
R=${CARGO_TARGET_DIR:-target}/release
S=$(mktemp -d)
trap 'rm -rf "$S"' EXIT
cp "$R/mirage-cli" "$R/xtask" "$S/"
while read -r name exe; do cp "$exe" "$S/$name"; done < <(test_executables -p mirage-cuda)
"$R/xtask" synth-model --tokenizer-only --tokenizer-from "$TOK_FROM" --out "$S/tok.gguf"
for f in "$S"/*; do [ "$f" = "$S/tok.gguf" ] || strip "$f"; done
mkdir -p "$OUT"
tar -cJf "$OUT/bins.tar.xz.tmp" -C "$S" . && mv "$OUT/bins.tar.xz.tmp" "$OUT/bins.tar.xz"
git rev-parse --short HEAD > "$OUT/COMMIT"
ls -la "$S" "$OUT"
