# Sourced by the device scripts (bash): the bundle builders here and the
# h200-*.sh scripts there.
#   test_executables CARGO_TEST_ARGS...  (dev machine) builds the test binaries
#                                   (`cargo test --release ARGS --no-run`) and
#                                   prints "name path" per test binary, from
#                                   cargo's JSON (not the newest file by time,
#                                   which can be a stale build);
# and two steps every device run needs:
#   device_unpack BIN_DIR WORK_DIR  unpacks BIN_DIR/bins.tar.xz (made by
#                                   bundle.sh) into WORK_DIR, or copies
#                                   BIN_DIR's files when there is no archive;
#   device_env WORK_DIR             puts the CUDA toolkit's libnvrtc on
#                                   LD_LIBRARY_PATH (cudarc loads it at run
#                                   time) and caches compiled PTX under
#                                   WORK_DIR/cache; sets NV to the library found.
device_unpack() {
  local bin=$1 w=$2
  mkdir -p "$w" || return 1
  if [ -f "$bin/bins.tar.xz" ]; then
    tar -xJf "$bin/bins.tar.xz" -C "$w" || return 1
  else
    cp "$bin"/* "$w"/ || return 1
  fi
  chmod +x "$w"/* 2>/dev/null
  return 0
}

device_env() {
  NV=$(find /usr/local/cuda* /usr/local/lib /opt /usr/lib -name 'libnvrtc.so*' 2>/dev/null | grep -v stub | head -1)
  export LD_LIBRARY_PATH="$(dirname "${NV:-/x/y}"):${LD_LIBRARY_PATH:-}"
  export MIRAGE_CUDA_CACHE=$1/cache
}

# The start of a device run: device_unpack and device_env, the GPU's name,
# driver, memory in use and clocks, the bundle's commit, and T0 (the clock
# `left` measures BUDGET from).
device_start() {
  local bin=$1 w=$2
  device_unpack "$bin" "$w" || return 1
  device_env "$w"
  nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm,clocks.max.sm,clocks.mem,power.draw \
    --format=csv,noheader
  [ -f "$bin/COMMIT" ] && echo "bundle commit $(cat "$bin/COMMIT")"
  T0=$SECONDS
}

test_executables() {
  nice cargo test --release "$@" --no-run --message-format json 2>/dev/null |
    python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("profile", {}).get("test") and m.get("executable") and "test" in m["target"]["kind"]:
        print(m["target"]["name"], m["executable"])'
}

# The step helpers of the h200-*.sh scripts (they set L, the log folder,
# T0=$SECONDS and BUDGET first):
#   run TAG LIMIT CMD...  runs CMD under `timeout LIMIT`, output in $L/TAG.log,
#                         prints "== TAG rc=... (N s)" and the test-result
#                         line when CMD is a test binary; returns CMD's status;
#   left WHAT             false (and says so) once BUDGET seconds have passed
#                         since T0: no new step starts after that.
run() {
  local tag=$1 lim=$2 t=$SECONDS; shift 2
  timeout "$lim" "$@" > "$L/$tag.log" 2>&1
  local r=$?
  echo "== $tag rc=$r ($((SECONDS - t)) s) $(grep -E '^test result' "$L/$tag.log" | head -1)"
  return $r
}
left() { [ $((SECONDS - T0)) -lt "$BUDGET" ] || { echo "(budget spent: skipping $1)"; return 1; }; }
