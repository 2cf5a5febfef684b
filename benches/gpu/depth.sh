#!/usr/bin/env bash
# Decode at depth on the GPU, in one run of about 8 minutes on an H100:
#
#   benches/gpu/depth.sh BUNDLE_DIR [LLAMA_BENCH]
#
# BUNDLE_DIR is what benches/gpu/bundle.sh made; LLAMA_BENCH, when given, a
# llama-bench binary built on this machine (benches/gpu_peer.sh build
# SRC.tar.xz DIR leaves it at DIR/build/bin/llama-bench). In order, each step
# under a time limit, none starting once BUDGET seconds have passed:
#   1. (in the background) synthetic Qwen2.5-0.5B Q8_0, 7B Q8_0 and 7B Q4_K
#      files, written by the bundle's `xtask synth-model` (random weights,
#      the real shapes; about 13 GB in WORK);
#   2. the mirage-cuda GPU suites of the attention (kernels, fast_decode,
#      kv_pruning_gpu, kv_pruning_backend, real_models; the real-model tests
#      need the model files in MIRAGE_MODELS_DIR, else they skip saying so);
#   3. per file: `mirage-cli bench --backend cuda --kv KV -d DEPTHS --gen N`
#      (decode tok/s after a context of each depth, the share of the copy
#      bandwidth counting weights and KV read per token, the time per op
#      class of one decode step run op by op between events) and, with
#      LLAMA_BENCH, `llama-bench -p 0 -n N -d D -ngl 99 -ctk KV -ctv KV` (the
#      same cache type), fewer repetitions at the deepest depth;
# then one table. Environment: WORK (default /tmp/mirage-depth), DEPTHS
# (default 0,4096,32768), GEN (decode steps per depth, default 64), BUDGET
# (default 500), MODELS (shape:quant list), SUITES (test binaries; empty for
# none), MIRAGE_MODELS_DIR, LLAMA_BUILD_PID (a llama-bench build
# running beside this script: the peer rows wait for it), LLAMA_FA
# (llama-bench's -fa: 0 by default; 1 for a build with FlashAttention, which
# llama.cpp needs for a q8_0 value cache), KV (the cache type of both: f16,
# the default, or q8_0), PRUNE (KV-page pruning settings, e.g.
# `page=16,sinks=4,recent=8,top=32,top_percent=10`: MIRAGE also decodes at
# the deepest depth with `--kv-prune PRUNE`, a row of its own).
set -uo pipefail
BUNDLE=$(cd "${1:?usage: depth.sh BUNDLE_DIR [LLAMA_BENCH]}" && pwd)
LB=${2:-}
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/lib.sh"
WORK=${WORK:-/tmp/mirage-depth}
DEPTHS=${DEPTHS:-0,4096,32768}
GEN=${GEN:-64}
LLAMA_FA=${LLAMA_FA:-0}
KV=${KV:-f16}
BUDGET=${BUDGET:-500}
gpu_start

MODELS=${MODELS:-qwen2.5-0.5b:q8_0 qwen2.5-7b:q8_0 qwen2.5-7b:q4_k}
synth_models

if [ -n "${MIRAGE_MODELS_DIR:-}" ] && [ -d "$MIRAGE_MODELS_DIR" ]; then
  export MIRAGE_MODELS_DIR
  echo "real models from $MIRAGE_MODELS_DIR"
else
  echo "MIRAGE_MODELS_DIR not set: the real-model tests skip"
fi
for s in ${SUITES-kernels fast_decode kv_pruning_gpu kv_pruning_backend real_models}; do
  # suite() sets MIRAGE_SKIP_MODEL_TESTS=1: a model file that is there runs.
  budget_left "suite $s" && SUITE_LIMIT=150 suite run "$W" "$s"
done

deepest=${DEPTHS##*,}
shallow=${DEPTHS%,*}
[ "$shallow" = "$DEPTHS" ] && shallow=
# MIRAGE's rows first, then the peer's: a llama-bench still building beside
# this run (benches/gpu_peer.sh build) has the longest to finish.
for m in $MODELS; do
  shape=${m%:*} q=${m#*:} f=$WORK/${m%:*}-${m#*:}.gguf tag=$shape-$q
  budget_left "$tag" || break
  wait_file "$f" || { echo "no $f (see $LOG/synth-$tag.log)"; continue; }
  step "mirage-$tag" 240 "$W/mirage-cli" bench --backend cuda --model "$f" --kv "$KV" -d "$DEPTHS" --gen "$GEN" --json
  if [ -n "${PRUNE:-}" ] && budget_left "pruned $tag"; then
    step "mirage-pruned-$tag" 240 "$W/mirage-cli" bench --backend cuda --model "$f" --kv "$KV" \
      --kv-prune "$PRUNE" -d "$deepest" --gen "$GEN" --json
  fi
done
await_llama_bench
for m in $MODELS; do
  [ -n "$LB" ] || break
  shape=${m%:*} q=${m#*:} f=$WORK/${m%:*}-${m#*:}.gguf tag=$shape-$q
  [ -f "$f" ] || continue
  if [ -n "$shallow" ] && budget_left "llama-bench $tag"; then
    step "llama-$tag" 150 "$LB" -m "$f" -ngl 99 -fa "$LLAMA_FA" -ctk "$KV" -ctv "$KV" -p 0 -n "$GEN" -d "$shallow" -r 3 -o json
  fi
  budget_left "llama-bench $tag at $deepest" &&
    step "llama-deep-$tag" 150 "$LB" -m "$f" -ngl 99 -fa "$LLAMA_FA" -ctk "$KV" -ctv "$KV" -p 0 -n "$GEN" -d "$deepest" -r 1 -o json
done
kill "$SYNTH" 2>/dev/null
wait 2>/dev/null
rm -f "$WORK"/*.gguf "$WORK"/*.gguf.part

echo
echo "## GPU suites (bundle $(cat "$BUNDLE/COMMIT" 2>/dev/null || echo '?'))"
printf '%-20s %7s %7s %7s\n' suite passed failed seconds
while read -r _ name p f s; do printf '%-20s %7s %7s %7s\n' "$name" "$p" "$f" "$s"; done < "$LOG/suites.txt"
echo
echo "## decode at depth: mirage-cli bench --kv $KV -d $DEPTHS --gen $GEN vs llama-bench -fa $LLAMA_FA -ctk $KV -ctv $KV -p 0 -n $GEN -d D"
python3 - "$LOG" "${PRUNE:-}" $MODELS <<'PY'
import json, os, sys
log, prune, models = sys.argv[1], sys.argv[2], sys.argv[3:]

def records(path):
    """The JSON of a log (a JSON line of mirage-cli, or llama-bench's array)."""
    try:
        text = open(path, errors="replace").read()
    except OSError:
        return None
    i = text.find("[")
    j = text.find("{")
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

print("| model | depth | MIRAGE tok/s | llama.cpp tok/s | ratio | MIRAGE share of copy | mat-vec | attention | other |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
for m in models:
    tag = m.replace(":", "-")
    mi = records(os.path.join(log, f"mirage-{tag}.log")) or {}
    peer = {}
    for name in (f"llama-{tag}.log", f"llama-deep-{tag}.log"):
        for r in records(os.path.join(log, name)) or []:
            if r.get("n_gen", 0) > 0 and r.get("n_prompt", 0) == 0:
                peer[r.get("n_depth", 0)] = r["avg_ts"]
    copy = mi.get("copy_gb_s")
    pruned = records(os.path.join(log, f"mirage-pruned-{tag}.log")) or {}
    for run in mi.get("runs", []) + [dict(r, pruned=True) for r in pruned.get("runs", [])]:
        d = run["depth"]
        p = run.get("profile") or {}
        share = lambda k: f"{100 * p[k]:.0f} %" if k in p else "-"
        ll = peer.get(d)
        ratio = f"{run['decode_tok_s'] / ll:.2f}x" if ll else "-"
        name = f"{m}, --kv-prune {prune}" if run.get("pruned") else m
        print(f"| {name} | {d} | {run['decode_tok_s']:.1f} | {f'{ll:.1f}' if ll else '-'} | {ratio} | "
              f"{100 * run['share_of_copy']:.0f} % | {share('matvec_share')} | {share('attention_share')} | "
              f"{share('other_share')} |")
    if not mi:
        print(f"| {m} | - | (no result: see {log}/mirage-{tag}.log) | | | | | | |")
    elif copy:
        print(f"|  | copy {copy:.0f} GB/s, {mi.get('device', '?')} | | | | | | | |")
PY
echo "share of copy: (weight + KV bytes read per token) x tok/s / device-to-device copy rate (read + written)"
echo "op classes: one decode step after the timed ones, its launches one by one between CUDA events"
echo "total $((SECONDS - T0)) s; logs in $LOG"
