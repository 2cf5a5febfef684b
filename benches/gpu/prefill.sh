#!/usr/bin/env bash
# Prefill on the GPU beside llama.cpp, in one run of about 6 minutes on an
# H100 (llama.cpp's build not counted):
#
#   benches/gpu/prefill.sh BUNDLE_DIR [LLAMA_BENCH]
#
# BUNDLE_DIR is what benches/gpu/bundle.sh made; LLAMA_BENCH, when given, a
# llama-bench binary built on this machine (benches/gpu_peer.sh build
# SRC.tar.xz DIR leaves it at DIR/build/bin/llama-bench). In order, each step
# under a time limit, none starting once BUDGET seconds have passed:
#   1. (in the background) synthetic Qwen2.5-0.5B Q8_0, 7B Q8_0 and 7B Q4_K
#      files, written by the bundle's `xtask synth-model` (random weights,
#      the real shapes; about 13 GB in WORK);
#   2. the mirage-cuda GPU suites of the prefill path (prefill_mmq: the int8
#      tensor-core products against f64 and a prefill against the batch-1
#      decode path; kernels and fast_decode: every weight type's batch
#      product and the tiny models' prefill against the mat-vecs and the CPU);
#   3. per file: `mirage-cli bench --backend cuda --kv f16 -p P -n 1` for P
#      in 512 and 8192 (ubatches of 512, as llama-bench's default) and, with
#      LLAMA_BENCH, `llama-bench -p 512,8192 -n 0 -ngl 99 -fa 0` (f16 KV);
# then one table. Environment: WORK (default /tmp/mirage-prefill), BUDGET
# (default 420), MODELS (shape:quant list), SUITES (test binaries; empty for
# none), REPS (default 3), LLAMA_BUILD_PID (a llama-bench build running
# beside this script: the peer rows wait for it).
set -uo pipefail
BUNDLE=$(cd "${1:?usage: prefill.sh BUNDLE_DIR [LLAMA_BENCH]}" && pwd)
LB=${2:-}
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/lib.sh"
WORK=${WORK:-/tmp/mirage-prefill}
BUDGET=${BUDGET:-420}
REPS=${REPS:-3}
gpu_start

MODELS=${MODELS:-qwen2.5-0.5b:q8_0 qwen2.5-7b:q8_0 qwen2.5-7b:q4_k}
synth_models

for s in ${SUITES-prefill_mmq kernels fast_decode}; do
  budget_left "suite $s" && SUITE_LIMIT=150 suite run "$W" "$s"
done
# The measured errors and cosines of the prefill suite (libtest keeps a
# passing test's output otherwise).
[ -x "$W/prefill_mmq" ] && MIRAGE_REQUIRE_CUDA_TESTS=1 step prefill_mmq-detail 60 "$W/prefill_mmq" --nocapture --test-threads 1

for m in $MODELS; do
  shape=${m%:*} q=${m#*:} f=$WORK/$shape-$q.gguf tag=$shape-$q
  wait_file "$f" || { echo "no $f (see $LOG/synth-$tag.log)"; continue; }
  for p in 512 8192; do
    budget_left "mirage $tag pp$p" &&
      step "mirage-$tag-pp$p" 150 "$W/mirage-cli" bench --backend cuda --model "$f" --kv f16 \
        -p "$p" -n 1 -r "$REPS" --json
  done
done
await_llama_bench
for m in $MODELS; do
  [ -n "$LB" ] || break
  shape=${m%:*} q=${m#*:} f=$WORK/$shape-$q.gguf tag=$shape-$q
  [ -f "$f" ] || continue
  budget_left "llama-bench $tag" &&
    step "llama-$tag" 150 "$LB" -m "$f" -ngl 99 -fa 0 -p 512,8192 -n 0 -r "$REPS" -o json
done
kill "$SYNTH" 2>/dev/null
wait 2>/dev/null
rm -f "$WORK"/*.gguf "$WORK"/*.gguf.part

echo
echo "## GPU suites (bundle $(cat "$BUNDLE/COMMIT" 2>/dev/null || echo '?'))"
printf '%-20s %7s %7s %7s\n' suite passed failed seconds
while read -r _ name p f s; do printf '%-20s %7s %7s %7s\n' "$name" "$p" "$f" "$s"; done < "$LOG/suites.txt"
grep -h "vs batch-1 decode\|mmq vs f64\|tensor-core vs mat-vec" "$LOG/prefill_mmq-detail.log" 2>/dev/null
echo
echo "## prefill tok/s: mirage-cli bench --kv f16 -p P -n 1 -r $REPS vs llama-bench -p 512,8192 -n 0 -fa 0 -r $REPS"
python3 - "$LOG" $MODELS <<'PY'
import json, os, sys
log, models = sys.argv[1], sys.argv[2:]

def records(path):
    """The JSON of a log (a JSON line of mirage-cli, or llama-bench's array)."""
    try:
        text = open(path, errors="replace").read()
    except OSError:
        return None
    i, j = text.find("["), text.find("{")
    if i >= 0 and (j < 0 or i < j):
        try:
            return json.loads(text[i:text.rindex("]") + 1])
        except ValueError:
            return None
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                pass
    return None

print("| model | prompt | MIRAGE tok/s | llama.cpp tok/s | ratio |")
print("|---|---:|---:|---:|---:|")
device = None
for m in models:
    tag = m.replace(":", "-")
    peer = {}
    for r in records(os.path.join(log, f"llama-{tag}.log")) or []:
        if r.get("n_gen", 1) == 0 and r.get("n_prompt", 0) > 0:
            peer[r["n_prompt"]] = (r["avg_ts"], r.get("stddev_ts", 0.0))
    for p in (512, 8192):
        mi = records(os.path.join(log, f"mirage-{tag}-pp{p}.log")) or {}
        device = device or mi.get("device")
        ours = mi.get("prompt_tok_s")
        sd = mi.get("prompt_tok_s_sd") or 0.0
        ll = peer.get(p)
        cell = f"{ours:.0f} ± {sd:.0f}" if ours else f"(no result: {log}/mirage-{tag}-pp{p}.log)"
        lcell = f"{ll[0]:.0f} ± {ll[1]:.0f}" if ll else "-"
        ratio = f"{ours / ll[0]:.2f}x" if ours and ll else "-"
        print(f"| {m} | {p} | {cell} | {lcell} | {ratio} |")
print(f"device: {device or '?'}")
PY
echo "total $((SECONDS - T0)) s; logs in $LOG"
