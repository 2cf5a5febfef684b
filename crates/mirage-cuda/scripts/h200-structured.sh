#!/usr/bin/env bash
# Device check of the runtime's structured-output pieces on CUDA: embeddings
# through the CUDA backend's ops against the CPU, and a JSON-schema constraint
# (mask applied on the host to the logits each step already reads back) with
# log-probabilities, on SmolLM2.
#
# Dev machine: bash crates/mirage-cuda/scripts/bundle.sh   (target/bundle/bins.tar.xz,
#              with the `real_models` test binary)
# Device:      bash crates/mirage-cuda/scripts/h200-structured.sh target/bundle MODELS_DIR
#              (MODELS_DIR holds smollm2-135m-instruct-q4_1.gguf, brought as h200.sh does)
# Prints one table: check | result | detail.
set -uo pipefail
BUNDLE=${1:?bundle dir}
MODELS=${2:?models dir}
W=/tmp/m-structured
OUT=${OUT:-/tmp/out}
mkdir -p "$W" "$OUT"
NV=$(find /usr/local/cuda* /usr/local/lib /opt /usr/lib -name 'libnvrtc.so*' 2>/dev/null | grep -v stub | head -1)
export LD_LIBRARY_PATH="$(dirname "${NV:-/x/y}"):${LD_LIBRARY_PATH:-}"
export MIRAGE_CUDA_CACHE=$W/cache
tar -xJf "$BUNDLE/bins.tar.xz" -C "$W" || exit 1
MIRAGE_REQUIRE_CUDA_TESTS=1 MIRAGE_MODELS_DIR=$MODELS "$W/real_models" --nocapture --test-threads 1 \
  smollm2_cuda_embeddings_and_constrained_decoding_match_cpu > "$OUT/structured.log" 2>&1
rc=$?
echo "| check | result | detail |"
echo "|---|---|---|"
grep -E '^embedding [0-9]+: cuda vs cpu cosine' "$OUT/structured.log" | while read -r line; do
  echo "| ${line%%:*} | cosine ${line##* } | >= 0.9999 required |"
done
grep -E '^(cuda|cpu) constrained output' "$OUT/structured.log" | while read -r line; do
  echo "| ${line%%:*} | ${line#*: } | |"
done
echo "| test | $([ $rc = 0 ] && echo pass || echo FAIL) | log: $OUT/structured.log |"
exit $rc
