#!/usr/bin/env bash
# Two bundles (benches/gpu/bundle.sh, or an older build of it) on the same
# GPU in one run, about 9 minutes on an H100:
#
#   benches/gpu/before_after.sh OLD_BUNDLE_DIR NEW_BUNDLE_DIR
#
#   1. a synthetic Qwen2.5-7B Q8_0 model (the new bundle's `xtask
#      synth-model`, about 8 GB in WORK);
#   2. on it, for each bundle in turn: `mirage-cli bench --backend cuda
#      --synthetic-pages` (the dense row and Q8_0 pages at 100 / 50 / 25 %
#      forced; the same flags in both) and `mirage-cli bench --backend cuda
#      --json` (prompt 512, 64 decoded tokens): decode and prompt tok/s and
#      the first 16 greedy tokens, which must be equal (the same bits);
#   3. the GPU suites of both bundles (the test binaries each holds: the
#      new and the old names), the two bundles' suites side by side at once,
#      with their pass and fail counts;
# then the tables. No step starts once BUDGET seconds (default 520) have
# passed. Environment: WORK (default /tmp/mirage-ab), SHAPE (the synthetic
# shape, default qwen2.5-7b).
set -uo pipefail
OLD=$(cd "${1:?usage: before_after.sh OLD_BUNDLE_DIR NEW_BUNDLE_DIR}" && pwd)
NEW=$(cd "${2:?usage: before_after.sh OLD_BUNDLE_DIR NEW_BUNDLE_DIR}" && pwd)
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/lib.sh"
WORK=${WORK:-/tmp/mirage-ab}
BUDGET=${BUDGET:-520}
SHAPE=${SHAPE:-qwen2.5-7b}
LOG=$WORK/log
mkdir -p "$LOG"
: > "$LOG/suites.txt"
: > "$LOG/rows.txt"
T0=$SECONDS
gpu_unpack "$OLD" "$WORK/old" || exit 1
gpu_unpack "$NEW" "$WORK/new" || exit 1
gpu_env "$WORK"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader

F=$WORK/$SHAPE-q8_0.gguf
step synth 240 "$WORK/new/xtask" synth-model --like "$SHAPE" --quant q8_0 --tokenizer-from "$WORK/new/tok.gguf" --out "$F"
for b in old new; do
  budget_left "$b sparse bench" || break
  step "sparse-$b" 200 "$WORK/$b/mirage-cli" bench --backend cuda --model "$F" --synthetic-pages \
    --page-format q8_0 --active 1.0,0.5,0.25 --prefix-dense off --prompt 16 --gen 66
  bench_rows "$b" "$LOG/sparse-$b.log" >> "$LOG/rows.txt"
done
for b in old new; do
  budget_left "$b dense bench" || break
  step "dense-$b" 150 "$WORK/$b/mirage-cli" bench --backend cuda --model "$F" --prompt 512 --gen 64 --json
  bench_rows "$b" "$LOG/dense-$b.log" | sed 's/\tdense\t/\tdense (prompt 512)\t/' >> "$LOG/rows.txt"
done
rm -f "$F"

# The suites: both bundles at once (they share the GPU; the counts, not the
# times, are what this compares).
run_suites() {
  for s in $GPU_SUITES sparse_kernels; do
    budget_left "$1 suite $s" && SUITE_LIMIT=${SUITE_LIMIT:-150} suite "$1" "$WORK/$1" "$s"
  done
}
run_suites old > "$LOG/suites-old.out" 2>&1 &
run_suites new > "$LOG/suites-new.out" 2>&1
wait
cat "$LOG/suites-old.out" "$LOG/suites-new.out"

echo
echo "## GPU suites: old $(cat "$OLD/COMMIT" 2>/dev/null || echo '?'), new $(cat "$NEW/COMMIT" 2>/dev/null || echo '?')"
printf '%-20s %15s %15s\n' suite "old pass/fail" "new pass/fail"
for s in $GPU_SUITES sparse_kernels; do
  o=$(awk -v s="$s" '$1 == "old" && $2 == s {print $3 "/" $4}' "$LOG/suites.txt")
  n=$(awk -v s="$s" '$1 == "new" && $2 == s {print $3 "/" $4}' "$LOG/suites.txt")
  [ -n "$o$n" ] && printf '%-20s %15s %15s\n' "$s" "${o:--}" "${n:--}"
done
echo
echo "## $SHAPE shape, Q8_0 (synthetic), decode tok/s"
python3 - "$LOG/rows.txt" <<'PY'
import sys
rows, order = {}, []
for line in open(sys.argv[1]):
    b, row, dec, pp = line.rstrip("\n").split("\t")
    if row not in order:
        order.append(row)
    rows[(b, row)] = (dec, pp)
print(f"{'row':<24} {'old':>10} {'new':>10} {'new/old':>8}   {'prompt old':>10} {'prompt new':>10}")
for row in order:
    o, n = rows.get(("old", row), ("-", "-")), rows.get(("new", row), ("-", "-"))
    try:
        ratio = f"{float(n[0]) / float(o[0]):.3f}"
    except ValueError:
        ratio = "-"
    print(f"{row:<24} {o[0]:>10} {n[0]:>10} {ratio:>8}   {o[1]:>10} {n[1]:>10}")
PY
echo
tok() { grep -o '"first_tokens":\[[^]]*\]' "$LOG/dense-$1.log" 2>/dev/null | head -1; }
if [ -n "$(tok old)" ] && [ "$(tok old)" = "$(tok new)" ]; then
  echo "greedy tokens: equal ($(tok new))"
else
  echo "greedy tokens: DIFFER: old $(tok old), new $(tok new)"
fi
echo "total $((SECONDS - T0)) s; logs in $LOG"
