#!/usr/bin/env bash
# The persistent decode step against the CUDA-graph step, on any machine
# with an NVIDIA GPU, its driver and the CUDA toolkit's libnvrtc (no Rust,
# no network):
#
#   benches/gpu/persistent.sh BUNDLE_DIR
#
# BUNDLE_DIR is what benches/gpu/bundle.sh made. In order, every GPU command
# under `timeout`:
#   1. synthetic Qwen2.5-0.5B Q8_0 and 7B Q4_K files (`xtask synth-model`);
#   2. the `persistent_decode` suite (persistent vs graph: logits cosine
#      >= 0.99999 and the same greedy tokens over 64 steps, f16 KV) on the
#      test models and on those two files (MIRAGE_PERSISTENT_MODELS);
#   3. `mirage-cli bench --backend cuda --kv f16 --prompt 32 --gen 128`
#      with `--decode graph` and `--decode persistent` on 0.5B Q8_0, 7B
#      Q4_K, then 7B Q8_0 (written after the 7B Q4_K file is removed);
# then one table: decode tok/s of both, their ratio, the share of the copy
# bandwidth of both (weights and KV read per token over a device copy's
# rate, measured in the same process), the steps that ran persistently,
# and whether the first greedy tokens agree. The first persistent run of a
# head size compiles its module (NVRTC, then the driver's JIT; cached under
# WORK/cache and the driver's cache), which the suite does first.
# Environment: WORK (default /tmp/mirage-gpu; about 9 GB free for the 7B
# Q8_0 file).
set -uo pipefail
BUNDLE=$(cd "${1:?usage: persistent.sh BUNDLE_DIR}" && pwd)
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/lib.sh"
WORK=${WORK:-/tmp/mirage-gpu}
LOG=$WORK/log
W=$WORK/bin
mkdir -p "$LOG"
: > "$LOG/persistent-rows.txt"
T0=$SECONDS
gpu_unpack "$BUNDLE" "$W" || exit 1
gpu_env "$W"
timeout 20 nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader

synth() {  # shape quant
  step "synth-$1-$2" 240 "$W/xtask" synth-model --like "$1" --quant "$2" --tokenizer-from "$W/tok.gguf" \
    --out "$WORK/$1-$2.gguf"
}

bench_pair() {  # shape quant
  local f=$WORK/$1-$2.gguf mode
  for mode in graph persistent; do
    step "bench-$mode-$1-$2" 240 "$W/mirage-cli" bench --backend cuda --model "$f" --kv f16 \
      --prompt 32 --gen 128 --decode "$mode" --json
  done
  python3 - "$1 $2" "$LOG/bench-graph-$1-$2.log" "$LOG/bench-persistent-$1-$2.log" \
    >> "$LOG/persistent-rows.txt" <<'PY'
import json, sys
def report(path):
    for line in open(path, errors="replace"):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                pass
    return None
tag, g, p = sys.argv[1], report(sys.argv[2]), report(sys.argv[3])
if g is None or p is None:
    print(f"| {tag} | {'failed' if g is None else round(g['decode_tok_s'], 1)} | "
          f"{'failed' if p is None else round(p['decode_tok_s'], 1)} | | | | | |")
else:
    same = "yes" if g["first_tokens"] == p["first_tokens"] else "NO"
    print(f"| {tag} | {g['decode_tok_s']:.1f} | {p['decode_tok_s']:.1f} | "
          f"{p['decode_tok_s'] / g['decode_tok_s']:.2f}x | {100 * g['share_of_copy']:.0f} % | "
          f"{100 * p['share_of_copy']:.0f} % | {p.get('persistent_steps')} | {same} |")
PY
}

synth qwen2.5-0.5b q8_0
synth qwen2.5-7b q4_k
export MIRAGE_PERSISTENT_MODELS="$WORK/qwen2.5-0.5b-q8_0.gguf,$WORK/qwen2.5-7b-q4_k.gguf"
MIRAGE_REQUIRE_CUDA_TESTS=1 step suite-persistent_decode 300 "$W/persistent_decode" --nocapture --test-threads=1
bench_pair qwen2.5-0.5b q8_0
bench_pair qwen2.5-7b q4_k
rm -f "$WORK/qwen2.5-7b-q4_k.gguf"
synth qwen2.5-7b q8_0 && bench_pair qwen2.5-7b q8_0
rm -f "$WORK"/qwen2.5-*.gguf

echo
echo "## persistent_decode suite (bundle $(cat "$BUNDLE/COMMIT" 2>/dev/null || echo '?'))"
grep -hE "persistent vs graph|^test |panicked|^test result" "$LOG/suite-persistent_decode.log" 2>/dev/null
echo
echo "## decode, graph vs persistent (mirage-cli bench --backend cuda --kv f16 --prompt 32 --gen 128)"
echo "| model | graph tok/s | persistent tok/s | ratio | graph % of copy | persistent % of copy | persistent steps | same first tokens |"
echo "|---|---:|---:|---:|---:|---:|---:|---|"
cat "$LOG/persistent-rows.txt"
echo
echo "total $((SECONDS - T0)) s; logs in $LOG"
