#!/usr/bin/env bash
# Device-machine driver for the CUDA backend checks (see ../NOTES.md).
# Binaries are built on the dev machine and carried (the device has no Rust):
#   .devbin/bins.tar.xz   mirage-cli (release) and the `kernels` test binary
#   .devbin/smol.part1    first half of SmolLM2 (the 64 MiB transfer limit)
#   .devbin2/smol.part2   second half, .devbin2/smol.sha256 its checksum
# Phase 1 unpacks and runs the kernel tests; phase 2 (same warm machine)
# assembles the model, runs the logits check and the benches.
set -uo pipefail
phase=$1
W=/tmp/m
OUT=${OUT:-/tmp/out}
mkdir -p "$W" "$OUT"
NV=$(find /usr/local/cuda* /usr/local/lib /opt /usr/lib -name 'libnvrtc.so*' 2>/dev/null | grep -v stub | head -1)
export LD_LIBRARY_PATH="$(dirname "${NV:-/x/y}"):${LD_LIBRARY_PATH:-}"
export MIRAGE_CUDA_CACHE=$W/cache
case $phase in
1)
  cp .devbin/smol.part1 "$W/" && tar -xJf .devbin/bins.tar.xz -C "$W" || exit 1
  nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv
  echo "nvrtc: ${NV:-none}"
  "$W/kernels" --nocapture --test-threads 1 --skip smollm2 2>&1 | tee "$OUT/kernels.log"
  ;;
2)
  cat "$W/smol.part1" .devbin2/smol.part2 > "$W/smollm2-135m-instruct-q4_1.gguf" || exit 1
  mkdir -p "$W/models" && mv "$W/smollm2-135m-instruct-q4_1.gguf" "$W/models/"
  (cd "$W/models" && sha256sum -c <(sed 's|models/||' "$OLDPWD/.devbin2/smol.sha256")) || exit 1
  M=$W/models/smollm2-135m-instruct-q4_1.gguf
  MIRAGE_MODELS_DIR=$W/models "$W/kernels" --nocapture --test-threads 1 smollm2 2>&1 | tee "$OUT/model.log"
  "$W/mirage-cli" bench --model "$M" --backend cuda --prompt 512 --gen 128 --json | tee "$OUT/bench_cuda.json"
  "$W/mirage-cli" bench --model "$M" --backend cuda --prompt 512 --gen 128 | tee "$OUT/bench_cuda.txt"
  "$W/mirage-cli" bench --model "$M" --backend cpu --prompt 512 --gen 128 --json | tee "$OUT/bench_cpu.json"
  "$W/mirage-cli" bench --model "$M" --backend cpu --prompt 512 --gen 128 | tee "$OUT/bench_cpu.txt"
  ;;
3)
  # Before/after in one run on SmolLM2 cut to its first 10 blocks (real
  # weights, fits one transfer): .devbin3/{bins-old,bins-new}.tar.xz, smol10.gguf
  mkdir -p "$W/old" "$W/new"
  tar -xJf .devbin3/bins-old.tar.xz -C "$W/old" && tar -xJf .devbin3/bins-new.tar.xz -C "$W/new" || exit 1
  nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv
  "$W/new/kernels" --nocapture --test-threads 1 --skip smollm2 2>&1 | tee "$OUT/kernels.log"
  M=.devbin3/smol10.gguf
  for v in old new old new; do
    "$W/$v/mirage-cli" bench --model "$M" --backend cuda --prompt 512 --gen 128 --json | tee -a "$OUT/bench_$v.json"
  done
  "$W/new/mirage-cli" bench --model "$M" --backend cpu --prompt 512 --gen 128 --json | tee "$OUT/bench_cpu.json"
  ;;
esac
