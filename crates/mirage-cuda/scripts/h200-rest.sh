#!/usr/bin/env bash
# Where the non-FFN part of the decode step goes (issue #7, "rest" in the
# sparse bench): after PDL and the fused attention changed little, this
# sweeps the existing launch-shape toggles on the 7B Q8_0 dense decode
# (the RMSNorm folded into the mat-vecs or not, mat-vec variants v2-v5,
# forced split-K) and takes three ncu kernel tables: the 0.5B dense step
# (the real-model shape, latency bound), the 7B dense step with the norm
# unfolded, and the 7B sparse step at 40 % active pages.
#
# Build here: bash crates/mirage-cuda/scripts/bundle.sh   (-> target/bundle)
# On the device (carry target/bundle):
#   bash crates/mirage-cuda/scripts/h200-rest.sh target/bundle
# The next run after the vector RMSNorm and the sparse norm fold (fifth
# session, not yet run on a GPU) — tests first (h200-pdl.sh's three test
# binaries hold the new bit-equality tests), then:
#   DENSE_CFGS="MIRAGE_CUDA_PDL=1;MIRAGE_CUDA_NORM=scalar;MIRAGE_CUDA_FUSE_NORM=0;MIRAGE_CUDA_FUSE_NORM=0 MIRAGE_CUDA_NORM=scalar"
#   SPARSE_CFGS="MIRAGE_CUDA_PDL=1;MIRAGE_SPARSE_FOLD_NORM=1;MIRAGE_CUDA_NORM=scalar"
# Then here: python3 crates/mirage-cuda/scripts/ncu_step_table.py LOG/ncu_*.csv
set -uo pipefail
BIN=${1:?usage: h200-rest.sh BIN_DIR}
W=${W:-/tmp/mq}
OUT=${OUT:-/tmp/out}
L=$W/log-rest
mkdir -p "$W" "$L" "$OUT"
. "$(dirname "$0")/common.sh"
device_start "$BIN" "$W" || exit 1
BUDGET=${BUDGET:-200}
for s in qwen2.5-7b qwen2.5-0.5b; do
  [ -f "$W/$s.gguf" ] || timeout 120 "$W/xtask" synth-model --like $s --quant q8_0 --out "$W/$s.gguf" \
    --tokenizer-from "$W/tok.gguf" > "$L/synth_$s.log" 2>&1
done
M7=$W/qwen2.5-7b.gguf M05=$W/qwen2.5-0.5b.gguf
: > "$L/tables.txt"
i=0
# DENSE_CFGS (";"-separated) overrides the dense rows; SPARSE_CFGS adds 7B
# sparse rows (--synthetic-pages --active 1.0,0.4,0.25) per setting.
DENSE_CFGS=${DENSE_CFGS:-"MIRAGE_CUDA_PDL=1;MIRAGE_CUDA_FUSE_NORM=0;MIRAGE_CUDA_MV=3;MIRAGE_CUDA_MV=4;MIRAGE_CUDA_MV=5;MIRAGE_CUDA_SPLITK=1;MIRAGE_CUDA_SPLITK=2;MIRAGE_CUDA_PDL=1"}
IFS=';' read -r -a DENSE_LIST <<< "$DENSE_CFGS"
for cfg in "${DENSE_LIST[@]}"; do
  left "7b $cfg" || break
  i=$((i + 1))
  run "d7_$i" 60 env $cfg "$W/mirage-cli" bench --backend cuda --model "$M7" --prompt 16 --gen 66 --kv f16 --json
  echo "7B dense $cfg: $(grep -oE '"decode_(tok_s|ms_median)":[0-9.]*' "$L/d7_$i.log" | tr '\n' ' ')" >> "$L/tables.txt"
done
IFS=';' read -r -a SPARSE_LIST <<< "${SPARSE_CFGS:-}"
for cfg in "${SPARSE_LIST[@]}"; do
  left "7b sparse $cfg" || break
  i=$((i + 1))
  run "s7_$i" 150 env $cfg "$W/mirage-cli" bench --backend cuda --model "$M7" --synthetic-pages \
    --active 1.0,0.4,0.25 --prompt 16 --gen 66
  { echo "== 7B q8_0 sparse, $cfg"; grep -vE '^\s*$|INFO|WARN' "$L/s7_$i.log" | tail -9; } >> "$L/tables.txt"
done
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
ncu_run() { # tag, timeout, one VAR=value, bench args...
  local tag=$1 lim=$2 setting=$3; shift 3
  run "ncu_$tag" "$lim" env "$setting" "$NCU" --graph-profiling node --cache-control none --clock-control none \
    --metrics gpu__time_duration.sum --csv --log-file "$L/ncu_$tag.csv" \
    "$W/mirage-cli" bench --backend cuda --kv f16 --prompt 16 --gen 4 "$@"
}
if [ -n "$NCU" ]; then
  left ncu05 && ncu_run 05 60 MIRAGE_CUDA_PDL=1 --model "$M05"
  left ncu7n && ncu_run 7_nofold 90 MIRAGE_CUDA_FUSE_NORM=0 --model "$M7"
  left ncu7s && ncu_run 7_sparse40 150 MIRAGE_CUDA_PDL=1 --model "$M7" --synthetic-pages --active 0.4 --prefix-dense off
fi
echo "total $((SECONDS - T0)) s"
tar -czf "$OUT/rest-logs.tgz" -C "$L" . 2>/dev/null
cat "$L/tables.txt"
