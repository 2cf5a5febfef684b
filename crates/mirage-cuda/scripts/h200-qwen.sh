#!/usr/bin/env bash
# The real-model runs on the H200 (issues #6 item 7, #7 real routed mode, #8
# NVFP4 decode, #10 long-context fidelity on the GPU), in stages, because a
# real model (Qwen2.5-Coder-0.5B Q4_K_M, 491 MB; SmolLM2-135M Q4_1, 98 MB)
# only reaches the device in pieces, one `device` call each (a piece plus the
# tracked tree, 9.3 MiB in Dec 2026, must stay under 64 MiB: e.g.
#   for i in $(seq 1 9); do mkdir -p .devbin-q/p$i; dd if=MODEL of=.devbin-q/p$i/piece \
#     bs=1M skip=$(( (i-1)*53 )) count=53 status=none; done
# with .devbin-q/ in .git/info/exclude, and `carry` .devbin-q/pN per call),
# appended under /tmp while the machine stays warm (it goes back after 30 s
# idle: issue the calls back to back).
#
#   h200-qwen.sh prep BIN_DIR PEER_SRC TEXT_DIR
#       unpacks BIN_DIR/bins.tar.xz (scripts/bundle.sh) into /tmp/mq, copies
#       TEXT_DIR (long.txt: evaluation text for eval-long; GPL-3: calibration
#       text for the artifact) and starts the llama.cpp build (benches/gpu_peer.sh
#       build PEER_SRC /tmp/peer) in the background, detached.
#   h200-qwen.sh append PIECE NAME
#       appends PIECE to /tmp/mq/models/NAME.
#   h200-qwen.sh run1
#       checks the models' sha256 (QWEN_SHA / SMOL_SHA), then: the real-model
#       tests (tests/real_models.rs: CUDA vs CPU logits cosine >= 0.9999 and
#       greedy equal on both models); the artifact build for the routed bench
#       in the background (xtask build-artifacts, GPL-3, 512 tokens);
#       eval-long on CUDA (full vs pruned attention at 16k and 32k with the
#       real model: final-logit cosine, PPL, needles, ms/token).
#   h200-qwen.sh run2
#       the peer table (benches/gpu_peer.sh compare: llama-bench vs mirage-cli
#       bench on Qwen as shipped, Qwen requantized to Q8_0 by `mirage-cli
#       quantize`, synth 0.5B Q8_0 and 7B Q8_0 / Q4_K); NVFP4 weight-only decode
#       beside the native formats; the sparse backend on the real artifact
#       (routed vs CPU superblock test; routed bench vs dense).
#   h200-qwen.sh sparse
#       the sparse part of run2 alone (artifact built first if missing):
#       the sparse_backend tests on the real artifact and the routed bench.
#   h200-qwen.sh table
#       issue #7's real-model rows in one go (after prep with PEER_SRC "-"
#       and the appends): sha256, the artifact (GPL-3, 512 tokens), the
#       sparse_backend tests on it (routed CUDA == CPU superblock), the routed
#       bench (RACTIVE prefix fractions + routed, dense in the same process;
#       again per TABLE_CFGS env setting), then the fidelity of the same
#       artifact on held-out text on the CPU (`mirage-cli eval`, GFDL-1.3,
#       384 tokens: recall, rejection, active fraction, logit cosine, top-1,
#       perplexity per router).
#   h200-qwen.sh vk VK_BIN GL_DIR
#       after table: the Vulkan RT router wired into the sparse backend
#       (tests/vk_interop.rs on the real model and artifact: lists and logits
#       equal route.cu's; `bench --routed --vulkan-router`).
# Logs under /tmp/mq/log (packed into $OUT/qwen-logs-STAGE.tgz); short tables on stdout.
set -uo pipefail
W=/tmp/mq
L=$W/log
OUT=${OUT:-/tmp/out}
QWEN_SHA=${QWEN_SHA:-1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32}
SMOL_SHA=${SMOL_SHA:-b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53}
mkdir -p "$W/models" "$L" "$OUT"
. "$(dirname "$0")/common.sh"
device_env "$W"
T0=$SECONDS
el() { echo "[$((SECONDS - T0)) s]"; }
Q=$W/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
S=$W/models/smollm2-135m-instruct-q4_1.gguf
PRUNE=(--page 16 --sink-pages 4 --recent-pages 8 --top-pages 32)

sparse_part() {
  if [ -f "$W/qwen.mirage" ]; then
    MIRAGE_SPARSE_MODEL=$Q MIRAGE_SPARSE_ARTIFACT=$W/qwen.mirage MIRAGE_REQUIRE_CUDA_TESTS=1 timeout 120 \
      "$W/sparse_backend" --test-threads 1 --nocapture > "$L/sparse_backend.log" 2>&1
    echo "sparse_backend rc=$? $(grep -E '^test result' "$L/sparse_backend.log")"
    grep -E 'panicked|routed|cosine' "$L/sparse_backend.log" | cut -c1-200 | head -8
    timeout 120 "$W/mirage-cli" bench --backend cuda --model "$Q" --artifact "$W/qwen.mirage" --routed \
      --active "${RACTIVE:-1.0,0.75,0.5}" --prompt 16 --gen 130 ${BENCH_EXTRA:-} > "$L/routed.txt" 2>&1
    echo "routed bench rc=$?"; el
  fi
}

# The logs go back as one archive: the device tool returns only a handful
# of files from $OUT and leaves the rest out (the twelfth session lost the
# table stage's logs that way).
save_logs() { tar -czf "$OUT/qwen-logs-$stage.tgz" -C "$L" . 2>/dev/null; }

stage=${1:?stage: prep | append | run1 | run2 | sparse | table | vk}
shift
case $stage in
prep)
  BIN=${1:?BIN_DIR}; PEER=${2:?PEER_SRC or -}; TEXT=${3:?TEXT_DIR}
  device_unpack "$BIN" "$W" || exit 1
  cp "$TEXT"/* "$W/"
  if [ "$PEER" != - ]; then
    cp "$PEER" "$W/peer-src.tar.xz"
    cp benches/gpu_peer.sh "$W/"
    setsid nohup bash -c "bash $W/gpu_peer.sh build $W/peer-src.tar.xz /tmp/peer > $L/peer-build.log 2>&1; echo rc=\$? >> $L/peer-build.log" \
      > /dev/null 2>&1 < /dev/null &
  fi
  nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
  ls "$W" | tr '\n' ' '; echo; el
  ;;
append)
  cat "${1:?PIECE}" >> "$W/models/${2:?NAME}" && ls -l "$W/models/$2"
  tail -1 "$L/peer-build.log" 2>/dev/null; pgrep -c -f 'cmake|nvcc|cicc' | sed 's/^/build processes: /'
  ;;
run1)
  for f in "$Q:$QWEN_SHA" "$S:$SMOL_SHA"; do
    sha=$(sha256sum "${f%%:*}" | cut -c1-64)
    [[ $sha == ${f##*:}* ]] && echo "sha256 ok $(basename "${f%%:*}")" || echo "SHA256 MISMATCH ${f%%:*}: $sha"
  done
  # The artifact for run2's routed bench, on the CPU while the GPU runs the rest.
  ( timeout 400 "$W/xtask" build-artifacts --model "$Q" --calib "$W/GPL-3" --max-tokens 512 --out "$W/qwen.mirage" \
      > "$L/artifact.log" 2>&1; echo "rc=$?" >> "$L/artifact.log" ) &
  MIRAGE_MODELS_DIR=$W/models MIRAGE_REQUIRE_CUDA_TESTS=1 timeout 150 "$W/real_models" --test-threads 1 --nocapture \
    > "$L/real_models.log" 2>&1
  echo "real_models rc=$? $(grep -E '^test result' "$L/real_models.log")"; el
  grep -E 'cosine|greedy|panicked' "$L/real_models.log" | cut -c1-220 | head -12
  timeout 330 "$W/mirage-cli" eval-long --backend cuda --model "$Q" --text "$W/long.txt" --ctx 16384,32768 --kv-f16 \
    "${PRUNE[@]}" --top-percent 20 --needle-depths 0.25,0.75 --ppl-tokens 32 > "$L/eval-long-20.txt" 2> "$L/eval-long-20.err"
  echo "eval-long top 20 % rc=$?"; el
  tail -3 "$L/eval-long-20.err"; cat "$L/eval-long-20.txt"
  left=$((560 - (SECONDS - T0)))
  if [ $left -gt 60 ]; then
    timeout $left "$W/mirage-cli" eval-long --backend cuda --model "$Q" --text "$W/long.txt" --ctx 32768 --kv-f16 \
      "${PRUNE[@]}" --top-percent 0 --needle-depths 0.25,0.75 --ppl-tokens 32 > "$L/eval-long-fixed.txt" 2> "$L/eval-long-fixed.err"
    echo "eval-long fixed budget rc=$?"; el
    tail -2 "$L/eval-long-fixed.err"; cat "$L/eval-long-fixed.txt"
  fi
  tail -2 "$L/artifact.log"
  save_logs
  ;;
run2)
  tail -2 "$L/peer-build.log"; tail -2 "$L/artifact.log"
  Q8=$W/models/qwen2.5-coder-0.5b-instruct-q8_0.gguf
  [ -f "$Q8" ] || timeout 60 "$W/mirage-cli" quantize "$Q" "$Q8" -t q8_0 > "$L/quantize.log" 2>&1
  echo "quantize q8_0 rc=$? $(ls -l "$Q8" | awk '{print $5}') bytes"
  for s in "qwen2.5-0.5b q8_0" "qwen2.5-7b q8_0" "qwen2.5-7b q4_k"; do
    set -- $s
    f=$W/models/synth-$1-$2.gguf
    [ -f "$f" ] || timeout 60 "$W/xtask" synth-model --like "$1" --quant "$2" --tokenizer-from "$W/tok.gguf" --out "$f" > /dev/null 2>&1
  done
  echo "synth models $(ls "$W"/models/synth-* | wc -l)"; el
  if [ -x /tmp/peer/build/bin/llama-bench ]; then
    PEER_REPS=2 PEER_OUT=$L/peer timeout 300 bash "$W/gpu_peer.sh" compare /tmp/peer/build/bin/llama-bench "$W/mirage-cli" \
      "$Q" "$Q8" "$W/models/synth-qwen2.5-0.5b-q8_0.gguf" "$W/models/synth-qwen2.5-7b-q8_0.gguf" \
      "$W/models/synth-qwen2.5-7b-q4_k.gguf" > "$L/peer.txt" 2>&1
    echo "peer rc=$?"; el
  else
    echo "no llama-bench: $(tail -3 "$L/peer-build.log" 2>/dev/null)"
  fi
  field() { grep -o "\"$2\":[^,}]*" "$1" | head -1 | cut -d: -f2 | tr -d '"'; }
  ROWS=()
  for m in "$Q" "$Q8" "$W/models/synth-qwen2.5-7b-q8_0.gguf" "$W/models/synth-qwen2.5-7b-q4_k.gguf"; do
    for w in native nvfp4; do
      j=$L/nv_$(basename "$m" .gguf)_$w.json
      timeout 90 "$W/mirage-cli" bench --model "$m" --backend cuda --prompt 128 --gen 64 --weights $w --json > "$j" 2> "${j%.json}.err"
      ROWS+=("$(printf '%-40s %-7s rc=%-3s %8.1f %8.3f %12s' "$(basename "$m" .gguf)" $w $? "$(field "$j" decode_tok_s)" \
        "$(field "$j" decode_ms_median)" "$(field "$j" weights_bytes)")")
    done
  done
  el
  sparse_part
  echo "== NVFP4 weight-only vs native decode (prompt 128 + 64, graphs on)"
  printf '%-40s %-7s %-6s %8s %8s %12s\n' model weights rc tok/s med_ms device_B
  printf '%s\n' "${ROWS[@]}"
  echo "== peer"; tail -8 "$L/peer.txt" 2>/dev/null
  echo "== routed"; tail -20 "$L/routed.txt" 2>/dev/null
  save_logs
  ;;
sparse)
  [ -f "$W/qwen.mirage" ] || timeout 120 "$W/xtask" build-artifacts --model "$Q" --calib "$W/GPL-3" --max-tokens 512 \
    --out "$W/qwen.mirage" > "$L/artifact.log" 2>&1
  tail -1 "$L/artifact.log"
  sparse_part
  echo "== routed"; tail -8 "$L/routed.txt" 2>/dev/null
  ;;
table)
  sha=$(sha256sum "$Q" | cut -c1-64)
  [[ $sha == "$QWEN_SHA" ]] && echo "sha256 ok $(basename "$Q")" || { echo "SHA256 MISMATCH $Q: $sha"; exit 1; }
  [ -f "$W/qwen.mirage" ] || timeout 200 "$W/xtask" build-artifacts --model "$Q" --calib "$W/GPL-3" --max-tokens 512 \
    --out "$W/qwen.mirage" > "$L/artifact.log" 2>&1
  echo "artifact rc=$? $(ls -l "$W/qwen.mirage" 2>/dev/null | awk '{print $5}') bytes"; el
  grep -iE 'margin|recall|trunk|routed' "$L/artifact.log" | tail -4 | cut -c1-200
  RACTIVE=${RACTIVE:-1.0,0.75,0.5,0.35,0.25} sparse_part
  echo "== routed, defaults"; grep -vE '^\s*$|INFO|WARN' "$L/routed.txt" | tail -9
  # TABLE_CFGS: ";"-separated env settings ("D" = the defaults), one more routed bench each.
  IFS=';' read -r -a TCFG <<< "${TABLE_CFGS:-}"
  i=0
  for cfg in "${TCFG[@]}"; do
    i=$((i + 1))
    [ "$cfg" = D ] && cfg=MIRAGE_DEFAULTS=1  # the defaults (env needs a setting), as in h200-pdl.sh
    timeout 120 env $cfg "$W/mirage-cli" bench --backend cuda --model "$Q" --artifact "$W/qwen.mirage" --routed \
      --active "${RACTIVE:-1.0,0.75,0.5,0.35,0.25}" --prompt 16 --gen 130 ${BENCH_EXTRA:-} > "$L/routed_$i.txt" 2>&1
    echo "== routed, $cfg (rc=$?)"; grep -vE '^\s*$|INFO|WARN' "$L/routed_$i.txt" | tail -9; el
  done
  timeout "${EVAL_LIMIT:-240}" "$W/mirage-cli" eval --artifact "$W/qwen.mirage" --model "$Q" --text "$W/GFDL-1.3" \
    --max-tokens 384 --max-fidelity-runs 4 > "$L/eval.txt" 2> "$L/eval.err"
  echo "== fidelity (mirage-cli eval, CPU) rc=$?"; el
  tail -2 "$L/eval.err"; cat "$L/eval.txt"
  save_logs
  ;;
vk)
  # The Vulkan RT router wired into the sparse backend, on the real model
  # and the table stage's artifact: VK_BIN from bundle-vkinterop.sh, the
  # Vulkan loader .debs in GL_DIR (see the device notes).
  VK_BIN=${1:?VK_BIN}; GL_DIR=${2:?GL_DIR}
  for f in "$GL_DIR"/*.deb; do dpkg -x "$f" /; done; ldconfig
  mkdir -p "$W/vk" && cp "$VK_BIN"/* "$W/vk/" && chmod +x "$W/vk"/*
  MIRAGE_SPARSE_MODEL=$Q MIRAGE_SPARSE_ARTIFACT=$W/qwen.mirage MIRAGE_REQUIRE_CUDA_TESTS=1 MIRAGE_REQUIRE_VK_RT=1 \
    timeout 200 "$W/vk/vk_interop" --test-threads 1 --nocapture > "$L/vk_interop.log" 2>&1
  echo "vk_interop rc=$? $(grep -E '^test result' "$L/vk_interop.log")"; el
  grep -E 'panicked|routed_decode|skipped' "$L/vk_interop.log" | cut -c1-240 | head -6
  timeout 200 "$W/vk/mirage-cli-vk" bench --backend cuda --model "$Q" --artifact "$W/qwen.mirage" --routed --vulkan-router \
    --prefix-dense off --active 1.0 --prompt 16 --gen 66 > "$L/routed_vk.txt" 2>&1
  echo "== routed, Vulkan RT router (rc=$?)"; grep -vE '^\s*$|INFO|WARN' "$L/routed_vk.txt" | tail -8; el
  save_logs
  ;;
*) echo "unknown stage $stage" >&2; exit 2 ;;
esac
