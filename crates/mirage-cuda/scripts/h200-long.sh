#!/usr/bin/env bash
# Device-side run for issue 10: KV-page pruned decode attention inside
# CudaBackend's decode graph (item 3), and the stand-alone kernels.
# Usage: h200-long.sh <bundle folder>
#   The folder holds bins.tar.xz (scripts/bundle.sh makes it) or the
#   files unpacked: mirage-cli, xtask, tok.gguf, pruned-attention-bench and
#   the test binaries kv_pruning_gpu and kv_pruning_backend (release, cuda
#   feature, stripped).
# 1. GPU tests (MIRAGE_REQUIRE_CUDA_TESTS=1): kv_pruning_gpu (device boxes ==
#    host min/max, every page == full split-K attention, device choice == the
#    CPU rule) and kv_pruning_backend (CudaBackend with pruning: every page ==
#    unpruned, real budget == CPU pruned per step, graph == eager, mixed
#    batches and truncation == CPU).
# 2. `xtask synth-model --like qwen2.5-0.5b --quant q8_0` on the device.
# 3. Whole-model decode, full vs pruned (`mirage-cli bench --kv-prune`), f16
#    KV, prompt 4096 / 16384 / 32768 + 32 generated tokens, graphs on;
#    pruned with 16-position pages (sinks 4, recent 8, top 32, top 20 %) and
#    with 64-position pages (sinks 1, recent 2, top 8, top 20 %).
# 4. Attention-only timing (pruned-attention-bench, page 16, 4k/16k/32k).
# Budget: < 4 minutes. Logs and JSON under $OUT; short table last.
set -uo pipefail
BIN=${1:?bundle folder}
W=/tmp/mirage-long
OUT=${OUT:-/tmp/out}
mkdir -p "$W" "$OUT"
. "$(dirname "$0")/common.sh"
device_unpack "$BIN" "$W" || exit 1
device_env "$W"
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
echo "nvrtc: ${NV:-none}"
T0=$SECONDS

tests() {  # tag, binary, timeout
  [ -x "$W/$2" ] || { echo "$1: $2 missing"; return; }
  MIRAGE_REQUIRE_CUDA_TESTS=1 timeout "$3" "$W/$2" --test-threads 1 --nocapture > "$OUT/test_$1.log" 2>&1
  echo "$1 rc=$? $(grep -E '^test result:' "$OUT/test_$1.log" | tail -1)"
  grep -E "panicked|FAILED|cosine|rel err" "$OUT/test_$1.log" | head -14
}
tests kv_pruning_gpu kv_pruning_gpu 60
tests kv_pruning_backend kv_pruning_backend 90

M=$W/synth-qwen2.5-0.5b-q8_0.gguf
[ -f "$M" ] || timeout 60 "$W/xtask" synth-model --like qwen2.5-0.5b --quant q8_0 \
  --tokenizer-from "$W/tok.gguf" --out "$M" > "$OUT/synth.log" 2>&1
echo "synth qwen2.5-0.5b q8_0 rc=$? $(tail -1 "$OUT/synth.log" 2>/dev/null) [$((SECONDS - T0)) s]"

P16=page=16,sinks=4,recent=8,top=32,top_percent=20
P64=page=64,sinks=1,recent=2,top=8,top_percent=20
field() { grep -o "\"$2\":[^,}]*" "$1" | head -1 | cut -d: -f2 | tr -d '"'; }
ROWS=()
for P in 4096 16384 32768; do
  for mode in full p16 p64; do
    case $mode in
      full) flags=() ;;
      p16) flags=(--kv-prune "$P16") ;;
      p64) flags=(--kv-prune "$P64") ;;
    esac
    j="$OUT/decode_${P}_$mode.json"
    timeout 60 "$W/mirage-cli" bench --model "$M" --backend cuda --prompt "$P" --gen 32 --kv f16 \
      --ubatch 512 "${flags[@]}" --json > "$j" 2> "${j%.json}.err"
    rc=$?
    ROWS+=("$(printf '%6s %-5s rc=%-3s %9s %9s %9s %7s %7s' "$P" "$mode" "$rc" \
      "$(field "$j" decode_tok_s)" "$(field "$j" decode_ms_median)" "$(field "$j" prompt_tok_s)" \
      "$(field "$j" graph_captures)" "$(field "$j" graph_replays)")")
    echo "${ROWS[-1]} [$((SECONDS - T0)) s]"
    [ $rc -ne 0 ] && tail -3 "${j%.json}.err"
  done
done

if [ $((SECONDS - T0)) -lt 170 ] && [ -x "$W/pruned-attention-bench" ]; then
  timeout 40 "$W/pruned-attention-bench" --contexts 4096,16384,32768 --iters 20 \
    --prune "page=16,sinks=4,recent=8,top=32" --prune "$P16" > "$OUT/pruned_bench16.txt" 2>&1
  echo "pruned-attention-bench page 16 rc=$?"
fi

echo
echo "== synthetic qwen2.5-0.5b q8_0, f16 KV, prompt + 32 decoded, graphs on: full vs pruned decode =="
echo "   p16 = $P16; p64 = $P64 [total $((SECONDS - T0)) s]"
printf '%6s %-5s %-6s %9s %9s %9s %7s %7s\n' prompt mode rc tok/s med_ms pp_tok/s capt repl
for r in "${ROWS[@]}"; do echo "$r"; done
if [ -f "$OUT/pruned_bench16.txt" ]; then
  echo "== attention only (ms per token, 24 layers) =="
  sed -n '/^| context/,$p' "$OUT/pruned_bench16.txt"
  grep -i "error\|panicked" "$OUT/pruned_bench16.txt" | head -3
fi
