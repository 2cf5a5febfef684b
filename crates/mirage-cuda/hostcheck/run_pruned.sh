#!/usr/bin/env bash
# Host check of cuda/attention_pruned.cu (no GPU): the kernels compiled as
# C++ with every CUDA thread an std::thread (check_pruned.cpp says how), the
# page choice against the CPU rule and the split-K attention over pages
# against f64. Needs g++ with C++20 (std::barrier).
set -euo pipefail
cd "$(dirname "$0")"
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
g++ -O1 -std=c++20 -pthread -I../../../cuda -o "$T/check_pruned" check_pruned.cpp
"$T/check_pruned"
