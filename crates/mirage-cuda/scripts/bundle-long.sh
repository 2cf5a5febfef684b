#!/usr/bin/env bash
# Builds the bundle h200-long.sh runs (on the dev machine, no GPU needed):
#   target/bundle-long/bins.tar.xz with mirage-cli, xtask,
#   pruned-attention-bench, the test binaries kv_pruning_gpu and
#   kv_pruning_backend (release, cuda feature, stripped) and tok.gguf (the
#   Qwen2.5 tokenizer alone, `xtask synth-model --tokenizer-only`, from
#   models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf or $TOKENIZER_FROM).
# Then, on the device (carry target/bundle-long):
#   bash crates/mirage-cuda/scripts/h200-long.sh target/bundle-long
set -euo pipefail
cd "$(dirname "$0")/../../.."
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target/cuda}
OUTDIR=target/bundle-long
TOK_FROM=${TOKENIZER_FROM:-models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf}
nice cargo build --release -p mirage-cuda -p mirage-cli -p xtask --bins
nice cargo test --release -p mirage-cuda --test kv_pruning_gpu --test kv_pruning_backend --no-run
S=$(mktemp -d)
trap 'rm -rf "$S"' EXIT
R=$CARGO_TARGET_DIR/release
cp "$R/mirage-cli" "$R/xtask" "$R/pruned-attention-bench" "$S/"
for t in kv_pruning_gpu kv_pruning_backend; do
  f=$(ls -t "$R"/deps/$t-* | grep -v '\.d$' | head -1)
  cp "$f" "$S/$t"
done
if [ -f "$TOK_FROM" ]; then
  "$R/xtask" synth-model --tokenizer-only --tokenizer-from "$TOK_FROM" --out "$S/tok.gguf"
else
  echo "no $TOK_FROM: set TOKENIZER_FROM to a Qwen2.5 GGUF or a tokenizer-only file" >&2
  exit 1
fi
strip "$S"/mirage-cli "$S"/xtask "$S"/pruned-attention-bench "$S"/kv_pruning_gpu "$S"/kv_pruning_backend
mkdir -p "$OUTDIR"
tar -cJf "$OUTDIR/bins.tar.xz" -C "$S" .
ls -la "$OUTDIR"
