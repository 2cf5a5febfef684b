#!/usr/bin/env bash
# Host checks of the kernels' device code (no GPU), compiled as C++ from the
# current sources (extract.py cuts the functions out of cuda/*.cu): the
# mat-vecs' dot helpers and element accessors, the RMSNorm row, the split decode
# attention and its combine, phases 1 and 2 of the fused Q8_0 FFN, and the pruned decode
# attention (attention_pruned.cu, included whole), the prefill int8
# tensor-core products (mmq.cu), the split-Q4_K and -Q6_K decode mat-vecs on int8
# tensor cores (matvec_imma.cu), the prefill attention and the split
# decode attention on f16 tensor cores (attention_mma.cu), the pruned
# decode attention on f16 tensor cores (union_pages, then attend_split_mma
# over each group's union of chosen pages) and the
# activation-sparse mat-vecs (activation_sparse.cu, included whole). The
# split, tensor-core split, pruned tensor-core and prefill attentions also run over q8_0 KV
# caches (kv_caches.h: the stores against ggml's quantizer, the arrays
# ending at an unreadable page). Blocks run as fibers on one thread
# (block_emu.h); PRMT and the int8 and f16 mma fragments are emulated per the PTX
# spec (ptx_emu.h, mma_emu.h), the asynchronous copies landing both at issue and
# at their wait (cp_async_emu.h).
# Needs python3 and g++ with C++20.
set -euo pipefail
cd "$(dirname "$0")"
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
python3 extract.py "$T"
for c in check_matvec check_norm check_split check_ffn_p1 check_ffn_p2 check_pruned check_mmq check_imma check_prefill_att check_split_mma check_pruned_mma check_activation_sparse; do
  g++ -O1 -std=c++20 -I"$T" -I. -I../../../cuda -o "$T/$c" "$c.cpp"
  "$T/$c"
done
