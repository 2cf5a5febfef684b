"""Cuts the device code the host checks run out of the kernel sources in
cuda/ (brace matching), so the checks always compile the current kernels.
Writes matvec_extract.h, norm_extract.h, split_extract.h, att_partial_extract.h,
ffn_p1_extract.h, ffn_p2_extract.h, mmq_extract.h, imma_extract.h, fa_extract.h, split_mma_extract.h,
union_extract.h and dequant_extract.h into the folder given (default: here)."""
import pathlib
import sys

root = pathlib.Path(__file__).resolve().parents[3]
src = "".join((root / "cuda" / f).read_text() for f in [
    "norm.cu", "nvfp4.cu", "ggml.cu", "attention.cu", "attention_prefill.cu", "matvec.cu", "matvec_lanes.cu",
    "matvec_split.cu", "matvec_imma.cu", "mmq.cu", "superblock.cu", "attention_mma.cu", "attention_pruned.cu"])


def extract(name):
    """The definition that starts with `name` (with its template line)."""
    i = src.index(name)
    ls = src.rfind("\n", 0, i) + 1
    prev = src.rfind("\n", 0, ls - 1) + 1
    if src[prev:ls].startswith("template"):
        ls = prev
    k = i
    if "(" in name:  # a function: its body's brace follows the parameters (a default may hold braces)
        k = src.index("(", i)
        depth = 0
        while True:
            if src[k] == "(":
                depth += 1
            elif src[k] == ")":
                depth -= 1
                if depth == 0:
                    break
            k += 1
    k = src.index("{", k)
    depth = 0
    while True:
        if src[k] == "{":
            depth += 1
        elif src[k] == "}":
            depth -= 1
            if depth == 0:
                break
        k += 1
    end = k + 1
    if src[end:end + 1] == ";":  # a struct
        end += 1
    return src[ls:end] + "\n"


def macro(name):
    """`#define name ...` with its continuation lines."""
    i = src.index("#define " + name)
    j = i
    while True:
        e = src.index("\n", j)
        if not src[j:e].rstrip().endswith("\\"):
            return src[i:e + 1]
        j = e + 1


def cut(*names):
    return "".join(macro(n[8:]) if n.startswith("#define ") else extract(n) for n in names)


out = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".")
norm = ["#define NORM_VEC", "float norm_warp_sum(", "float norm_block_sum(", "void rms_norm_row_by(",
        "void rms_norm_row("]

# The mat-vecs' dot helpers, row pointers and element accessors, with the
# ggml dequantizers they are checked against.
(out / "matvec_extract.h").write_text(cut(
    "#define GGML_TYPES", "#define GGML_TY_ID", "enum GgmlType", "#define FAST_WARPS", "#define FAST_ROWS",
    "#define SB_MAGIC", "#define MV_NR", "#define MV_U_Q8",
    "float sb_byte_f32(", "void sb_q8x4(", "void sb_e2m1x4_doubled(", "float sb_e4m3(", "int pick3(",
    "void scale_min_k4(", "void dequant_unit<TY_Q8_0>(", "void dequant_unit<TY_Q4_K>(",
    "void dequant_unit<TY_Q5_0>(", "void dequant_unit<TY_Q6_K>(", "void mv3_slice(",
    "float q8s_elem(", "float e2m1_f32(", "float nvfp4_elem(", "u32 q4k_scale_byte(", "void q4k_scale_min(",
    "float q4ks_elem(", "float q5s_elem(", "float q6ks_elem(",
    "void nvfp4_dot(", "void q5s_dot(", "struct Nvfp4Rows", "struct Q5sRows",
    "struct MvvRows", "const u8* mvv_q(", "const u8* mvv_m(", "MvvRows ffn_rows(", "void q8s_load16(",
    "void q8s_compute16(", "void q8s_dot16(", "MvvRows mv3_rows("))

(out / "norm_extract.h").write_text(cut(*norm, "void sb_stage_x("))

# The split decode attention and its combine, with RoPE and the KV store.
split = ["#define ATT_MIN_KEYS", "int att_chunk(", "#define AS_THREADS", "#define AS_TILE", "#define AS_MAX_G",
         "#define AS_LPK", "#define AS_MAX_SPLITS", "bool pruned_row(", "#define AC_THREADS", "#define AC_BATCH",
         "void attend_combine_body("]
# The q8_0 cache (KvQ8) and its loads, every cache type's element size and
# stores (kv_store_pair: a q8_0 row quantized across lanes).
kv_q8 = ["struct KvQ8", "KvQ8 operator+(KvQ8", "float kv_load(KvQ8", "constexpr int kv_bytes(const T*", "constexpr int kv_bytes(KvQ8"]
kv_store = ["void kv_store(float*", "void kv_store(u16*", "float kv_round(const float*", "float kv_round(const u16*",
            "void kv_store_pair(T*", "i8 q8_code(", "void kv_store_pair(KvQ8"]
(out / "split_extract.h").write_text(cut(
    *kv_q8, "void kv_prefetch(const T*", "void kv_prefetch(KvQ8", *kv_store,
    "void rope_angle(", "void rope_turn(", "void rope_cs(", "void rope_table_body(", "void rope_store(", *split,
    "uint4 kv_unit(const T*", "uint4 kv_unit(KvQ8",
    "void kv_unpack(uint4 r, const float*", "void kv_unpack(uint4 r, const u16*", "void kv_unpack(uint4 r, KvQ8",
    "void kv_load_n(const float*", "void kv_load_n(const u16*", "void kv_load_n(KvQ8", "struct SplitHeads",
    "SplitHeads split_heads(", "void attend_split_with(", "void split_copy_q(", "void attend_split(",
    "void attend_split_rope("))

# The attention's partial store and the combine, for the pruned attention
# (check_pruned.cpp includes attention_pruned.cu whole).
(out / "att_partial_extract.h").write_text(cut(
    "struct KvQ8", "KvQ8 operator+(KvQ8", "float kv_load(KvQ8", "#define KV_SCALES_f32", "#define KV_SCALES_f16",
    "#define KV_SCALES_q8_0", "#define KV_CACHE_f32", "#define KV_CACHE_f16", "#define KV_CACHE_q8_0",
    "void att_rescale(", "void att_store_partial(", *split))

# Phase 1 of the fused Q8_0 FFN (superblock.cu) with the helpers it calls.
(out / "ffn_p1_extract.h").write_text(cut(
    "#define SB_WARPS", "#define SB_THREADS", "#define SB_PAGE_CH", "#define SB_P1_VECS", "#define SB_P1B_UNITS",
    "#define SB_MAGIC", "float sb_warp_sum(", "float sb_byte_f32(", "void sb_q8x4(", "float sb_q8_dot4(", *norm,
    "void sb_stage_x(", "struct SbQ8sRows", "SbQ8sRows sb_q8s_rows(", "void sb_q8s_round(",
    "void sb_ffn_q8s_phase1("))

# Phase 2 of the fused Q8_0 FFN (superblock.cu) with the helpers it calls.
(out / "ffn_p2_extract.h").write_text(cut(
    "#define SB_WARPS", "#define SB_THREADS", "#define SB_PAGE_CH", "#define SB_P2_QUADS", "#define SB_MAGIC",
    "float sb_byte_f32(", "void sb_q8x4(", "void nv_reduce_scatter(", "void sb_q8x16_axpy(",
    "void sb_q8s_p2_quads(", "void sb_sum_chunk_parts(", "void sb_finish_item(", "void sb_ffn_q8s_phase2("))

# The prefill int8 tensor-core products (mmq.cu) with the split layouts'
# element accessors they are checked against; the mma and cp.async
# instructions themselves are mma_emu.h's and cp_async_emu.h's.
(out / "mmq_extract.h").write_text(cut(
    "float q8s_elem(", "float q5s_elem(",
    "#define MMQ_K", "#define MMQ_LD", "#define MMQ_STAGE_BYTES", "#define MMQ_STAGES", "#define MMQ_BIAS",
    "#define MMQ_BIAS_F", "#define MMQ_Q8_0", "#define MMQ_Q5_0",
    "void quantize_q8_block(", "struct MmqStage", "struct MmqQ5Held", "void mmq_fetch_rows(", "void mmq_fetch_x(", "void mmq_fetch_w_q8(",
    "void mmq_load_w_q5(", "void mmq_store_w_q5(", "u32 mmq_word(", "void mmq_stage_product(", "void mmq_tile("))

# The decode mat-vecs of split Q4_K and Q6_K on int8 tensor cores (matvec_imma.cu)
# with the accessor they are checked against; the mma instruction is
# mma_emu.h's.
(out / "imma_extract.h").write_text(cut(
    "#define FAST_WARPS", "#define IMMA_ROWS", "u32 q4k_scale_byte(", "void q4k_scale_min(", "float q4ks_elem(",
    "float q6ks_elem(", "struct ImmaX", "void mv_store(", "void imma_quantize_x(", "void imma_q4k_dot(",
    "u32 q6k_imma_word(", "int imma_byte_i8(", "u32 imma_word(", "void imma_q6k_dot(", "#define IMMA_Q4K",
    "#define IMMA_Q6K", "void imma_dot(", "void imma_slice(", "void imma_xsplit("))

# The prefill attention on f16 tensor cores (attention_prefill.cu); the mma
# instruction is mma_emu.h's.
(out / "fa_extract.h").write_text(cut(
    "#define FA_ROWS", "#define FA_KEYS", "#define FA_WARPS", "#define FA_LOG2E", "u32 fa_pack(", "u32 fa_word(",
    "struct KvQ8", "KvQ8 operator+(KvQ8", "float kv_load(KvQ8", "void fa_stage(const u16*", "void fa_stage(KP K",
    "void attend_prefill(", "float attend_prefill_merge("))

# The split decode attention on f16 tensor cores (attention_mma.cu), the
# combine and rope_store (the reference of its folded RoPE and store); the
# mma and cp.async instructions are mma_emu.h's and cp_async_emu.h's, the
# f16x2 h2_sub and h2_mul att_emu.h's.
(out / "split_mma_extract.h").write_text(cut(
    *kv_q8, *kv_store, "void rope_turn(", "void rope_cs(", "void rope_store(",
    "#define ATT_MIN_KEYS", "int att_chunk(", "#define AS_MAX_SPLITS", "bool pruned_row(", "#define AC_THREADS",
    "#define AC_BATCH", "void attend_combine_body(", "u32 fa_pack(", "u32 fa_word(", "#define TM_KEYS",
    "#define TM_MAX_G", "int tm_warps(", "int tm_stages(", "#define TM_STAGE_HALVES", "#define TM_Q8_LD",
    "#define TM_Q8_STAGE_BYTES", "void tm_issue(", "void tm_issue_q8(", "u32 q8_h2(", "float tm_rope_q(",
    "struct MmaPages", "void attend_split_mma("))

# The union of a KV head's group's page choices (attention_pruned.cu), which
# the pruned decode attention on f16 tensor cores (attend_split_mma with
# PAGES) walks; with split_mma_extract.h.
(out / "union_extract.h").write_text(cut(
    "#define SEL_THREADS", "unsigned long long block_scan_excl(", "void union_pages("))

# ggml's Q8_0, Q4_K, Q4_1, Q5_0 and Q6_K dequantizers (ggml.cu), the reference the
# activation-sparse products (activation_sparse.cu, included whole) are
# checked against.
(out / "dequant_extract.h").write_text(cut(
    "#define GGML_TYPES", "#define GGML_TY_ID", "enum GgmlType", "void scale_min_k4(", "void dequant_unit<TY_Q8_0>(",
    "void dequant_unit<TY_Q4_K>(", "void dequant_unit<TY_Q4_1>(", "void dequant_unit<TY_Q5_0>(",
    "void dequant_unit<TY_Q6_K>("))
