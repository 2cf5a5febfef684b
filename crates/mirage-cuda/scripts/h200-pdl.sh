#!/usr/bin/env bash
# Device-side A/B of programmatic dependent launch (cuda/pdl.cu) and the
# mat-vecs' L2 weight prefetch, issue #7: the non-FFN part of the decode
# step ("rest" in the sparse bench) is what bounds sparse vs dense, and it
# is mostly kernel-boundary latency.
#
# Build here: bash crates/mirage-cuda/scripts/bundle.sh   (-> target/bundle)
# Then on the device (carry target/bundle):
#   bash crates/mirage-cuda/scripts/h200-pdl.sh target/bundle
# Order: GPU tests (PDL on vs off and fused vs split attention bit-equal,
# the dense kernels vs the CPU backend, the sparse backend with PDL on), synthetic 7B Q8_0 dense vs sparse
# (100/40/25 %): the previous launch path (PDL, prefetch and fused attention
# off), PDL alone, + the L2 prefetch, + the fused attention (all defaults),
# defaults with 8 KiB prefetch rows, defaults with the fused FFN variants 6
# and 7 (phase 1 prefetches the down rows into L2); the 0.5B
# shape dense with PDL off / on, then one ncu pass over a 7B dense decode
# (kernel durations, for the per-kernel table; ncu serializes kernels, so it
# shows work, not gaps). Switches: SKIP_FAST_DECODE=1, SKIP_SPARSE_TESTS=1, SKIP_KERNEL_TESTS=1,
# KBENCH=1 (kernel-bench --sparse after the 7B rows; KBENCH_ARGS more of its
# arguments, e.g. "--sparse-variants 0,3,10"), FLOOR=1 (kernel-bench
# --launch-floor after that), SKIP_NCU=1,
# PAGE_FORMATS="" (no Q2_K / NVFP4 rows), BENCH_EXTRA (more arguments of
# every 7B bench row, e.g. --xprefetch-ab), TABLE_LINES (bench lines kept
# per row in tables.txt, default 14). Binaries stay unpacked in $W (default /tmp/mq, the
# directory h200-qwen.sh's stages use). Raw logs in $OUT/pdl-logs.tgz.
set -uo pipefail
BIN=${1:?usage: h200-pdl.sh BIN_DIR}
W=${W:-/tmp/mq}
OUT=${OUT:-/tmp/out}
L=$W/log
mkdir -p "$W" "$L" "$OUT"
. "$(dirname "$0")/common.sh"
device_start "$BIN" "$W" || exit 1
export MIRAGE_REQUIRE_CUDA_TESTS=1
BUDGET=${BUDGET:-480}
if [ "${SKIP_FAST_DECODE:-0}" != 1 ]; then
  # The bundle carries no real model: their SmolLM2 tests skip, saying so
  # (MIRAGE_MODELS_DIR and MIRAGE_SKIP_MODEL_TESTS=0 run them when one is there).
  export MIRAGE_SKIP_MODEL_TESTS=${MIRAGE_SKIP_MODEL_TESTS:-1}
  run fast_decode 240 "$W/fast_decode" --nocapture --test-threads 1
  grep -E "panicked|FAILED|PDL on|skipped" "$L/fast_decode.log" | cut -c1-160 | head -6
  # The dense kernels against the CPU backend (8 s); it went unrun from the
  # sixth to the twelfth session, and a stale check in it failed unnoticed.
  run kernels 60 "$W/kernels" --nocapture --test-threads 1
  grep -E "panicked|FAILED|skipped" "$L/kernels.log" | cut -c1-160 | head -4
fi
if [ "${SKIP_SPARSE_TESTS:-0}" != 1 ]; then
  MIRAGE_SKIP_MODEL_TESTS=1 run sparse_backend 150 "$W/sparse_backend" --nocapture --test-threads 1
  grep -E "panicked|FAILED" "$L/sparse_backend.log" | head -4
fi
[ "${SKIP_KERNEL_TESTS:-0}" = 1 ] || run sparse_kernels 100 "$W/sparse_kernels" --test-threads 1
: > "$L/tables.txt"
for s in qwen2.5-7b qwen2.5-0.5b; do
  timeout 120 "$W/xtask" synth-model --like $s --quant q8_0 --out "$W/$s.gguf" --tokenizer-from "$W/tok.gguf" > "$L/synth_$s.log" 2>&1
  echo "synth $s rc=$?"
done
M7=$W/qwen2.5-7b.gguf
i=0
B0="MIRAGE_CUDA_PDL=0 MIRAGE_CUDA_PREFETCH=0 MIRAGE_CUDA_ATTN_FUSE=0 MIRAGE_SPARSE_FOLD_ADD=0"
# CFGS (";"-separated env settings, "B0" = everything off) picks the 7B rows
# when device time is short; the default is the full A/B list.
CFGS=${CFGS:-"B0;MIRAGE_CUDA_PREFETCH=0 MIRAGE_CUDA_ATTN_FUSE=0;MIRAGE_CUDA_ATTN_FUSE=0;MIRAGE_CUDA_PDL=1;MIRAGE_SPARSE_FOLD_ADD=0;MIRAGE_CUDA_PREFETCH=8192;MIRAGE_SPARSE_Q8_KERNEL=6;MIRAGE_SPARSE_Q8_KERNEL=7"}
IFS=';' read -r -a CFG_LIST <<< "$CFGS"
for cfg in "${CFG_LIST[@]}"; do
  [ "$cfg" = B0 ] && cfg=$B0
  [ "$cfg" = D ] && cfg=MIRAGE_DEFAULTS=1  # the defaults (env needs a setting)
  pd=${PREFIX_DENSE:-off}
  [ "$cfg" = DP ] && { cfg=MIRAGE_DEFAULTS=1; pd=on; }  # defaults + the prefix-slice rows
  left "7b $cfg" || break
  i=$((i + 1))
  run "b7_$i" 150 env $cfg "$W/mirage-cli" bench --backend cuda --model "$M7" --synthetic-pages --prefix-dense $pd \
    --active ${ACTIVE:-1.0,0.4,0.25} --prompt 16 --gen 66 ${BENCH_EXTRA:-}
  { echo "== 7B q8_0, $cfg"; grep -vE '^\s*$|INFO|WARN' "$L/b7_$i.log" | tail -${TABLE_LINES:-14}; } >> "$L/tables.txt"
done
for pdl in ${PDL_05B:-off on off on}; do
  left "0.5b $pdl" || break
  i=$((i + 1))
  run "b05_$i" 60 "$W/mirage-cli" bench --backend cuda --model "$W/qwen2.5-0.5b.gguf" --prompt 16 --gen 256 \
    --kv f16 --cuda-pdl $pdl --json
  echo "== 0.5B q8_0 dense, --cuda-pdl $pdl: $(grep -o '"decode_tok_s":[0-9.]*' "$L/b05_$i.log")" >> "$L/tables.txt"
done
# CFGS05 (";"-separated env settings, "D" = defaults): 0.5B dense rows per
# setting, after the PDL_05B rows (set PDL_05B=" " to skip those).
IFS=';' read -r -a CFG05_LIST <<< "${CFGS05:-}"
# A setting that changes a module's defines (e.g. MIRAGE_CUDA_ATT_LOADS=serial)
# compiles that module's PTX at its first launch, 45-75 s on the H200, more
# than a 0.5B row's limit (the thirteenth session lost a row that way): one
# short decode per distinct setting first puts it in the PTX cache.
printf '%s\n' "${CFG05_LIST[@]}" | sort -u | while read -r cfg; do
  [ -z "$cfg" ] || [ "$cfg" = D ] && continue
  run b05_warm 150 env $cfg "$W/mirage-cli" bench --backend cuda --model "$W/qwen2.5-0.5b.gguf" --prompt 4 --gen 2
done
for cfg in "${CFG05_LIST[@]}"; do
  [ "$cfg" = D ] && cfg=MIRAGE_DEFAULTS=1
  left "0.5b $cfg" || break
  i=$((i + 1))
  run "b05_$i" 60 env $cfg "$W/mirage-cli" bench --backend cuda --model "$W/qwen2.5-0.5b.gguf" --prompt 16 --gen 256 \
    --kv f16 --json
  echo "== 0.5B q8_0 dense, $cfg: $(grep -o '"decode_tok_s":[0-9.]*' "$L/b05_$i.log")" >> "$L/tables.txt"
done
if [ "${KBENCH:-0}" = 1 ] && left kernel-bench; then
  # The fused FFN kernels alone (every variant, 7B and 0.5B shapes, CUDA
  # graphs, cold pages) beside the dense FFN and the copy ceiling.
  run kbench 240 "$W/kernel-bench" --iters 20 --sparse ${KBENCH_ARGS:-}
  { echo "== kernel-bench --sparse"; sed -n '/== sparse FFN variants/,$p' "$L/kbench.log"; } >> "$L/tables.txt"
fi
if [ "${FLOOR:-0}" = 1 ] && left launch-floor; then
  # What one decode-graph node costs by itself (pdl_floor: the PDL
  # handshake and one dependent increment), plain and with PDL.
  run floor 60 "$W/kernel-bench" --iters 20 --launch-floor
  { echo "== kernel-bench --launch-floor"; sed -n '/^launch floor/,$p' "$L/floor.log"; } >> "$L/tables.txt"
fi
NCU=$( [ "${SKIP_NCU:-0}" = 1 ] || command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
if [ -n "$NCU" ] && left ncu; then
  # NCU_ENV (one VAR=value) and NCU_EXTRA (more bench arguments, e.g.
  # "--synthetic-pages --active 0.4 --prefix-dense off") pick the step.
  run ncu 150 env ${NCU_ENV:-MIRAGE_DEFAULTS=1} "$NCU" --graph-profiling node --cache-control none --clock-control none \
    --metrics gpu__time_duration.sum --csv --log-file "$L/ncu.csv" \
    "$W/mirage-cli" bench --backend cuda --model "$M7" --prompt 16 --gen 4 --kv f16 ${NCU_EXTRA:-}
  echo "ncu rows: $(wc -l < "$L/ncu.csv" 2>/dev/null)"
fi
for pf in ${PAGE_FORMATS-q2_k nvfp4}; do
  left "7b $pf" || break
  run "b7_$pf" 150 "$W/mirage-cli" bench --backend cuda --model "$M7" --synthetic-pages --page-format $pf \
    --active 1.0,0.4,0.25 --prompt 16 --gen 66
  { echo "== 7B, defaults, --page-format $pf"; grep -vE '^\s*$|INFO|WARN' "$L/b7_$pf.log" | tail -9; } >> "$L/tables.txt"
done
[ "${KEEP_MODELS:-0}" = 1 ] || rm -f "$W"/qwen2.5-*.gguf  # KEEP_MODELS=1: h200-rest.sh reuses them
echo "total $((SECONDS - T0)) s"
tar -czf "$OUT/pdl-logs.tgz" -C "$L" . 2>/dev/null
echo; cat "$L/tables.txt"
