#!/usr/bin/env bash
# Why each kernel of a 7B Q8_0 decode step takes what it takes (issue #7's
# "measured reason"): one ncu pass per kernel family with the speed-of-light,
# warp-state, occupancy, launch and memory sections, inside the decode graph
# (--graph-profiling node), L2 flushed before every replay (weights are
# streamed from DRAM in a real step), clocks not locked.
#   dense: mv3_* (Q/K/V with the folded norm, O, down), attend_rope_*,
#          ffn_q8_0s_* (gate/up/SwiGLU), from the dense decode;
#   sparse: superblock_ffn_q8s_* phases 1 and 2 at 40 % active pages.
# Needs h200-pdl.sh's unpacked bundle and 7B model in $W (run that with
# KEEP_MODELS=1 first, or set M7). Then on this machine:
#   python3 crates/mirage-cuda/scripts/ncu_detail_table.py OUT/ncu-*.csv
set -uo pipefail
W=${W:-/tmp/mq}
OUT=${OUT:-/tmp/out}
L=$W/log
M7=${M7:-$W/qwen2.5-7b.gguf}
mkdir -p "$L" "$OUT"
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "no ncu"; exit 1; }
[ -f "$M7" ] || { echo "no $M7"; exit 1; }
SECTIONS="--section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis"
prof() {
  local tag=$1 filter=$2 skip=$3 count=$4 t=$SECONDS
  timeout 200 "$NCU" --graph-profiling node --cache-control all --clock-control none $SECTIONS \
    -k "regex:$filter" --launch-skip "$skip" --launch-count "$count" --csv --page raw \
    --log-file "$OUT/ncu-$tag.csv" \
    "$W/mirage-cli" bench --backend cuda --model "$M7" --synthetic-pages --active 0.4 --prefix-dense off \
    --prompt 16 --gen 4 > "$L/ncu-$tag.log" 2>&1
  echo "== ncu $tag rc=$? ($((SECONDS - t)) s), $(wc -l < "$OUT/ncu-$tag.csv" 2>/dev/null) csv lines"
}
# PARTS: which of the two passes run (default both).
for part in ${PARTS:-dense sparse}; do
  case $part in
    # Dense: past the prompt and the first decode steps, one layer and a half.
    dense) prof dense '^(mv3_q8_0s|attend_rope|ffn_q8_0s)' "${DENSE_SKIP:-400}" "${DENSE_COUNT:-6}" ;;
    # Sparse: both phases of two layers, after two decode steps.
    sparse) prof sparse '^superblock_ffn_q8s' "${SPARSE_SKIP:-112}" "${SPARSE_COUNT:-4}" ;;
  esac
done
