#!/usr/bin/env bash
# Builds the one bundle every h200-*.sh script takes as BIN_DIR (on the dev
# machine, no GPU needed): target/bundle/bins.tar.xz with mirage-cli, xtask,
# kernel-bench, pruned-attention-bench, every mirage-cuda test binary (under
# its test name: fast_decode, kernels, kv_pruning_gpu, ...), all release with
# the cuda feature and stripped, and tok.gguf (the Qwen2.5 tokenizer alone,
# `xtask synth-model --tokenizer-only`, from
# models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf or $TOKENIZER_FROM).
# Then, on the device (carry target/bundle):
#   bash crates/mirage-cuda/scripts/h200-matvec.sh target/bundle   (or h200-long.sh, h200-dense.sh, ...)
set -euo pipefail
cd "$(dirname "$0")/../../.."
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target/cuda}
OUTDIR=${OUTDIR:-target/bundle}
TOK_FROM=${TOKENIZER_FROM:-models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf}
[ -f "$TOK_FROM" ] || { echo "no $TOK_FROM: set TOKENIZER_FROM to a Qwen2.5 GGUF or a tokenizer-only file" >&2; exit 1; }
nice cargo build --release -p mirage-cuda -p mirage-cli -p xtask --bins
. crates/mirage-cuda/scripts/common.sh
tests=$(test_executables -p mirage-cuda)
S=$(mktemp -d)
trap 'rm -rf "$S"' EXIT
R=$CARGO_TARGET_DIR/release
cp "$R/mirage-cli" "$R/xtask" "$R/kernel-bench" "$R/pruned-attention-bench" "$S/"
while read -r name exe; do cp "$exe" "$S/$name"; done <<< "$tests"
"$R/xtask" synth-model --tokenizer-only --tokenizer-from "$TOK_FROM" --out "$S/tok.gguf"
for f in "$S"/*; do [ "$f" = "$S/tok.gguf" ] || strip "$f"; done
mkdir -p "$OUTDIR"
tar -cJf "$OUTDIR/bins.tar.xz.tmp" -C "$S" . && mv "$OUTDIR/bins.tar.xz.tmp" "$OUTDIR/bins.tar.xz"
git rev-parse --short HEAD > "$OUTDIR/COMMIT"
ls -la "$S" "$OUTDIR"
