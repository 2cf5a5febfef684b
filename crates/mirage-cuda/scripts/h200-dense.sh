#!/usr/bin/env bash
# Device-side check of the fast dense decode path (issue #6) and NVFP4
# weights (#8); see ../NOTES.md.
#
#   h200-dense.sh BIN_DIR MODEL [MODEL ...]
#
# MODEL is a GGUF path, or synth:LIKE:QUANT (e.g. synth:qwen2.5-7b:q4_k):
# a shape-true random model written on the device by the bundled `xtask
# synth-model` with the bundled tokenizer-only GGUF (7B Q4_K: 4.3 GB in
# ~20 s; Q8_0 8.1 GB in ~40 s); synthetic models get the fast and old modes
# only, prompt 32 + 32 (the NVFP4 requantization of 7B weights on one CPU
# core takes minutes).
#
# BIN_DIR holds bins.tar.xz (mirage-cli with the cuda feature, the
# mirage-cuda test binaries `fast_decode` and `kernels`, `xtask` and
# `tok.gguf` for synthetic models; release, stripped;
# made by the lead's bundle step) or those binaries unpacked. For each model
# it runs `mirage-cli bench --backend cuda` with the fast path (default),
# the old path (`--cuda-fast off`, the first version's kernels and ggml
# layout) and NVFP4 weights (`--weights nvfp4`), prompt 128 + 64 generated
# tokens, graphs on, and the fast path without the norm folded into the
# next mat-vec (`nonorm`: MIRAGE_CUDA_FUSE_NORM=0), and the fast path without the split-K mat-vecs
# (`splitk1`: MIRAGE_CUDA_SPLITK=1, one warp per row group as before 2026-12-03). Tests run first (MIRAGE_REQUIRE_CUDA_TESTS=1): the fast
# path against the old one and NVFP4 against the CPU codec
# (tests/fast_decode.rs), then the original kernel tests on the fast path
# (the default) and on the old path (MIRAGE_CUDA_FAST=0). Budget < 3 min.
# Mat-vec variants of the split Q8_0 / Q4_K layouts (MIRAGE_CUDA_MV): modes
# `mvN` (variant N, split-K by the rule) and `mvNkS` (variant N, split S
# forced); `mv1` is the default kernels. MODES="fast mv2 mv3 mv4" (env)
# replaces the mode list of every model (default: as below).
# Raw logs and JSON go to $OUT; a short table is printed last.
set -uo pipefail
BIN_DIR=${1:?usage: h200-dense.sh BIN_DIR MODEL.gguf [MODEL.gguf ...]}
shift
W=/tmp/mirage-dense
OUT=${OUT:-/tmp/out}
mkdir -p "$W" "$OUT"
. "$(dirname "$0")/common.sh"
device_unpack "$BIN_DIR" "$W" || exit 1
device_env "$W"
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
echo "nvrtc: ${NV:-none}"

# The SmolLM2 model test of fast_decode needs models/smollm2-135m-instruct-q4_1.gguf
# (MIRAGE_MODELS_DIR); without it it is skipped, saying so.
export MIRAGE_SKIP_MODEL_TESTS=${MIRAGE_SKIP_MODEL_TESTS:-1}
tests() {  # tag, binary, "VAR=value ..." (or ""), test-binary arguments...
  local tag=$1 bin=$2 vars=$3; shift 3
  [ -x "$W/$bin" ] || { echo "$tag: $bin missing"; return; }
  env MIRAGE_REQUIRE_CUDA_TESTS=1 $vars timeout 60 "$W/$bin" --test-threads 1 --nocapture "$@" > "$OUT/test_$tag.log" 2>&1
  echo "$tag rc=$? $(grep -E '^test result:' "$OUT/test_$tag.log" | tail -1)"
  grep -E "panicked|FAILED|failed" "$OUT/test_$tag.log" | head -5
}
tests fast_decode fast_decode ""
grep -E "fused vs unfused|GEMM on the repacked|NVFP4 cuda" "$OUT/test_fast_decode.log" | head -8
tests kernels_fast kernels "" --skip smollm2 --skip qwen
tests kernels_old kernels "MIRAGE_CUDA_FAST=0" --skip smollm2 --skip qwen

field() { grep -o "\"$2\":[^,}]*" "$1" | head -1 | cut -d: -f2 | tr -d '"'; }
ROWS=()
for M in "$@"; do
  modes=${MODES:-"fast splitk1 old nonorm nvfp4"}
  len="--prompt 128 --gen 64"
  if [[ $M == synth:* ]]; then
    IFS=: read -r _ like quant <<< "$M"
    M=$W/synth-$like-$quant.gguf
    [ -f "$M" ] || timeout 90 "$W/xtask" synth-model --like "$like" --quant "$quant" \
      --tokenizer-from "$W/tok.gguf" --out "$M" > "$OUT/synth-$like-$quant.log" 2>&1
    echo "synth $like $quant rc=$? $(tail -1 "$OUT/synth-$like-$quant.log")"
    modes=${MODES:-"fast splitk1 old"}
    len="--prompt 32 --gen 32"
  fi
  name=$(basename "$M" .gguf)
  for mode in $modes; do
    fuse=1 splitk=0 mv=1
    case $mode in
      fast) flags="--cuda-fast on" ;;
      splitk1) flags="--cuda-fast on"; splitk=1 ;;
      old) flags="--cuda-fast off" ;;
      nonorm) flags="--cuda-fast on"; fuse=0 ;;
      nvfp4) flags="--cuda-fast on --weights nvfp4" ;;
      mv[1-9]|mv[1-9]k[1248])
        flags="--cuda-fast on"; mv=${mode:2:1}
        [[ $mode == *k* ]] && splitk=${mode##*k} ;;
      *) echo "unknown mode $mode"; continue ;;
    esac
    j="$OUT/bench_${name}_$mode.json"
    MIRAGE_CUDA_MV=v$mv MIRAGE_CUDA_SPLITK=$splitk MIRAGE_CUDA_FUSE_NORM=$fuse timeout 60 "$W/mirage-cli" bench --model "$M" --backend cuda $len $flags --json > "$j" 2> "${j%.json}.err"
    rc=$?
    ROWS+=("$(printf '%-34s %-6s rc=%-3s %9s %9s %8s %8s %9s' "$name" "$mode" "$rc" \
      "$(field "$j" decode_tok_s)" "$(field "$j" decode_ms_median)" "$(field "$j" achieved_gb_s)" \
      "$(field "$j" copy_gb_s)" "$(field "$j" weights_bytes)")")
  done
done
echo
echo "decode (prompt 128 + 64; synthetic 32 + 32), graphs on (GB/s counts the file's weight bytes per token; weights_B = device bytes)"
printf '%-34s %-6s %-6s %9s %9s %8s %8s %9s\n' model mode rc tok/s med_ms GB/s copyGB/s weights_B
for r in "${ROWS[@]}"; do echo "$r"; done
