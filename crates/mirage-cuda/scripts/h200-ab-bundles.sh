#!/usr/bin/env bash
# A/B of two bundles (bundle.sh) on the device, for changes a run-time switch
# cannot select (kernel source, register use): the same synthesized 7B and
# 0.5B Q8_0 models, decoded by each bundle's mirage-cli in alternating
# processes, ROUNDS times (B, A, B, A, ...: the order bias of a warming GPU
# falls on neither side every round). Run after h200-pdl.sh with KEEP_MODELS=1
# (it leaves the models and bundle B unpacked in $W), or alone: the models are
# synthesized when missing.
#
#   bash crates/mirage-cuda/scripts/h200-ab-bundles.sh NEW_BIN_DIR OLD_BIN_DIR
#
# ACTIVE (default 1.0,0.4,0.25) and ROUNDS (default 2) pick the 7B rows.
# Prints one table: per process, dense and each sparse step in ms, and the
# 0.5B dense tok/s.
set -uo pipefail
NEW=${1:?usage: h200-ab-bundles.sh NEW_BIN_DIR OLD_BIN_DIR}
OLD=${2:?usage: h200-ab-bundles.sh NEW_BIN_DIR OLD_BIN_DIR}
W=${W:-/tmp/mq}
WO=${WO:-/tmp/mq-old}
OUT=${OUT:-/tmp/out}
L=$W/log-ab
mkdir -p "$W" "$WO" "$L" "$OUT"
. "$(dirname "$0")/common.sh"
device_start "$OLD" "$WO" || exit 1
device_start "$NEW" "$W" || exit 1
BUDGET=${BUDGET:-400}
for s in qwen2.5-7b qwen2.5-0.5b; do
  [ -f "$W/$s.gguf" ] && continue
  timeout 120 "$W/xtask" synth-model --like $s --quant q8_0 --out "$W/$s.gguf" --tokenizer-from "$W/tok.gguf" > "$L/synth_$s.log" 2>&1
  echo "synth $s rc=$?"
done
: > "$L/table.txt"
for r in $(seq 1 "${ROUNDS:-2}"); do
  for side in new old; do
    d=$W
    [ $side = old ] && d=$WO
    left "round $r $side" || break 2
    run "b7_${side}_$r" 150 "$d/mirage-cli" bench --backend cuda --model "$W/qwen2.5-7b.gguf" --synthetic-pages \
      --prefix-dense off --active "${ACTIVE:-1.0,0.4,0.25}" --prompt 16 --gen 66
    run "b05_${side}_$r" 60 "$d/mirage-cli" bench --backend cuda --model "$W/qwen2.5-0.5b.gguf" --prompt 16 \
      --gen 256 --kv f16 --json
    # "dense 3.70 | sparse 40% 2.76 | ..." from the bench table's step-ms column.
    steps=$(awk '/^dense +100/{ printf "dense %s | ", $5 } /^sparse [0-9]/ && $3 ~ /%$/ { printf "sparse %s %s | ", $2, $6 }' \
      "$L/b7_${side}_$r.log")
    echo "round $r $side: ${steps}0.5B $(grep -o '"decode_tok_s":[0-9.]*' "$L/b05_${side}_$r.log" | cut -d: -f2) tok/s" \
      >> "$L/table.txt"
  done
done
echo "total $((SECONDS - T0)) s"
tar -czf "$OUT/ab-logs.tgz" -C "$L" . 2>/dev/null
echo; echo "new $(cat "$NEW/COMMIT" 2>/dev/null), old $(cat "$OLD/COMMIT" 2>/dev/null); 7B step ms, 0.5B dense tok/s"
cat "$L/table.txt"
