# Shared by the GPU benchmark scripts (sourced by bash):
#
#   test_executables CARGO_ARGS...   (build machine) builds the test binaries
#                                    (`cargo test --release ARGS --no-run`)
#                                    and prints "name path" per binary, from
#                                    cargo's JSON;
#   gpu_start                        (GPU machine) the start of a script:
#                                    LOG=$WORK/log and W=$WORK/bin made,
#                                    $LOG/suites.txt and rows.txt emptied,
#                                    T0 set, $BUNDLE unpacked into $W,
#                                    gpu_env, the GPU named;
#   gpu_unpack BUNDLE_DIR WORK_DIR   (GPU machine) unpacks
#                                    BUNDLE_DIR/bins.tar.xz into WORK_DIR;
#   gpu_env WORK_DIR                 puts the CUDA toolkit's libnvrtc on
#                                    LD_LIBRARY_PATH (the kernels are
#                                    compiled at run time) and caches their
#                                    PTX under WORK_DIR/cache;
#   step TAG LIMIT CMD...            runs CMD under `timeout LIMIT`, its
#                                    output in $LOG/TAG.log, and prints
#                                    "== TAG rc=N (S s)";
#   budget_left WHAT                 false (saying so) once $BUDGET seconds
#                                    have passed since $T0;
#   suite TAG WORK_DIR NAME          runs test binary NAME of WORK_DIR (the
#                                    GPU suites must run there:
#                                    MIRAGE_REQUIRE_CUDA_TESTS=1) and adds
#                                    "TAG NAME passed failed seconds" to
#                                    $LOG/suites.txt;
#   bench_rows TAG LOGFILE           the rows of a `mirage-cli bench` table
#                                    or JSON line in LOGFILE as
#                                    "TAG<TAB>row<TAB>decode tok/s<TAB>prompt
#                                    tok/s" lines.

# The GPU suites of mirage-cuda, by test binary name (a bundle may lack some).
GPU_SUITES="kernels fast_decode prefill_mmq sparse_backend kv_pruning_gpu kv_pruning_backend sparse_pages real_models"

test_executables() {
  nice cargo test --release "$@" --no-run --message-format json 2>/dev/null |
    python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("profile", {}).get("test") and m.get("executable") and "test" in m["target"]["kind"]:
        print(m["target"]["name"], m["executable"])'
}

gpu_unpack() {
  mkdir -p "$2" && tar -xJf "$1/bins.tar.xz" -C "$2" && chmod +x "$2"/* 2>/dev/null
  [ -f "$1/COMMIT" ] && echo "bundle $1: commit $(cat "$1/COMMIT")"
  return 0
}

gpu_start() {
  LOG=$WORK/log
  W=$WORK/bin
  mkdir -p "$LOG"
  : > "$LOG/suites.txt"
  : > "$LOG/rows.txt"
  T0=$SECONDS
  gpu_unpack "$BUNDLE" "$W" || exit 1
  gpu_env "$W"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
}

gpu_env() {
  local nv
  nv=$(find /usr/local/cuda* /usr/local/lib /opt /usr/lib -name 'libnvrtc.so*' 2>/dev/null | grep -v stub | head -1)
  export LD_LIBRARY_PATH="$(dirname "${nv:-/x/y}"):${LD_LIBRARY_PATH:-}"
  export MIRAGE_CUDA_CACHE=$1/cache
  echo "nvrtc: ${nv:-not found}"
}

step() {
  local tag=$1 lim=$2 t=$SECONDS
  shift 2
  timeout "$lim" "$@" > "$LOG/$tag.log" 2>&1
  local r=$?
  echo "== $tag rc=$r ($((SECONDS - t)) s)"
  return $r
}

# Writes the synthetic files of MODELS (shape:quant) into WORK, one after
# another in the background (the CPU writes them while the GPU runs the
# suites); SYNTH is the writer's process.
synth_models() {
  (
    for m in $MODELS; do
      local shape=${m%:*} q=${m#*:}
      step "synth-$shape-$q" 300 "$W/xtask" synth-model --like "$shape" --quant "$q" \
        --tokenizer-from "$W/tok.gguf" --out "$WORK/$shape-$q.gguf.part" &&
        mv "$WORK/$shape-$q.gguf.part" "$WORK/$shape-$q.gguf"
    done
  ) > "$LOG/synth.out" 2>&1 &
  SYNTH=$!
}

# Waits until the file of $1 is written (or its writer gave up).
wait_file() {
  while [ ! -f "$1" ] && kill -0 "$SYNTH" 2>/dev/null; do sleep 2; done
  [ -f "$1" ]
}

# Waits for the llama-bench binary LB while its build (process
# LLAMA_BUILD_PID) runs; clears LB when there is none.
await_llama_bench() {
  # (Without LLAMA_BUILD_PID there is nothing to wait for: `kill -0 0`
  # would signal this process group and succeed.)
  while [ -n "$LB" ] && [ ! -x "$LB" ] && [ -n "${LLAMA_BUILD_PID:-}" ] &&
    kill -0 "$LLAMA_BUILD_PID" 2>/dev/null && budget_left "llama-bench build"; do
    sleep 5
  done
  if [ -n "$LB" ] && [ ! -x "$LB" ]; then echo "no llama-bench at $LB: the peer columns stay empty"; LB=; fi
}

budget_left() {
  [ $((SECONDS - T0)) -lt "$BUDGET" ] || { echo "(budget of $BUDGET s spent: skipping $1)"; return 1; }
}

suite() {
  local tag=$1 w=$2 name=$3 t=$SECONDS
  [ -x "$w/$name" ] || return 0
  MIRAGE_REQUIRE_CUDA_TESTS=1 MIRAGE_SKIP_MODEL_TESTS=1 step "$tag-$name" "${SUITE_LIMIT:-240}" "$w/$name"
  local res passed failed
  res=$(grep -E '^test result' "$LOG/$tag-$name.log" | tail -1)
  passed=$(sed -n 's/.* \([0-9]*\) passed.*/\1/p' <<< "$res")
  failed=$(sed -n 's/.* \([0-9]*\) failed.*/\1/p' <<< "$res")
  echo "$tag $name ${passed:-?} ${failed:-?} $((SECONDS - t))" >> "$LOG/suites.txt"
  grep -E "panicked|^test .* FAILED" "$LOG/$tag-$name.log" | head -5
}

bench_rows() {
  python3 - "$1" "$2" <<'PY'
import json, re, sys
tag, path = sys.argv[1], sys.argv[2]
for line in open(path, errors="replace"):
    line = line.rstrip("\n")
    if line.startswith("{"):
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if "prompt_tok_s" in r:  # the dense bench's JSON
            print(f"{tag}\tdense\t{r['decode_tok_s']:.1f}\t{r['prompt_tok_s']:.1f}")
        continue
    # A row of the sparse bench's table: mode, active %, tok/s, ...
    m = re.match(r"^(\S.*?)\s+(\d+\.\d)%\s+(\d+\.\d)\s", line)
    if m and not line.startswith("mode"):
        print(f"{tag}\t{m.group(1)}\t{m.group(3)}\t-")
PY
}
