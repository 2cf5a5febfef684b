#!/usr/bin/env bash
# Host checks of the fast-path device helpers (no GPU): the per-lane dot
# helpers of the split Q8_0 / Q4_K / Q5_0 / Q6_K and NVFP4 layouts, summed over the
# 32 lanes of a warp, against references on odd shapes, and their element
# accessors against dequant_unit<T> (bit-equal), the RMSNorm row, the decode
# attention and phases 1 and 2 of the fused Q8_0 FFN run as emulated blocks
# (block_emu.h), and the attention block kernel (Q/K/V, attention and O in one grid) as concurrent
# emulated blocks. PRMT is emulated per the PTX spec in ptx_emu.h. Needs
# python3 and g++.
set -euo pipefail
cd "$(dirname "$0")"
T=$(mktemp -d)
python3 extract.py "$T"
cp prelude.h ptx_emu.h "$T"/
for c in check_q8s_nvfp4 check_q4ks check_q5s check_q6ks check_mvv check_norm check_attend check_ffn_p1 check_ffn_p2 check_attn_block; do
  g++ -O1 -std=c++20 -pthread -I"$T" -o "$T/$c" "$c.cpp"
  "$T/$c"
done
rm -rf "$T"
