"""Cuts the device functions the host checks need out of cuda/norm.cu +
cuda/nvfp4.cu + cuda/dense.cu + cuda/superblock.cu (brace matching), so the checks always
compile the current kernel source. Writes kernels_extract.h, q4k_extract.h, q5_extract.h,
q6k_extract.h, mvv_extract.h, norm_extract.h, attend_extract.h, ffn_p1_extract.h,
ffn_p2_extract.h and attn_block_extract.h."""
import pathlib, sys

root = pathlib.Path(__file__).resolve().parents[3]
src = ((root / "cuda/norm.cu").read_text() + (root / "cuda/nvfp4.cu").read_text() + (root / "cuda/dense.cu").read_text()
       + (root / "cuda/superblock.cu").read_text())


def extract(name):
    i = src.index(name)
    ls = src.rfind("\n", 0, i) + 1
    prev = src.rfind("\n", 0, ls - 1) + 1
    if src[prev:ls].startswith("template"):
        ls = prev
    k = src.index("{", i)
    depth = 0
    while True:
        if src[k] == "{":
            depth += 1
        elif src[k] == "}":
            depth -= 1
            if depth == 0:
                break
        k += 1
    return src[ls : k + 1] + "\n"


def macro_line(name):
    i = src.index("#define " + name)
    return src[i : src.index("\n", i) + 1]


def macro(name):
    i = src.index("#define " + name)
    return src[i : src.index('extern "C"', i)]


out = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".")
fwd = "template <int T> void dequant_unit(const u8* row, int u, float* w);\n"
(out / "kernels_extract.h").write_text("".join(extract(n) for n in [
    "float sb_byte_f32(", "void sb_q8x4(", "void sb_e2m1x4_doubled(", "float sb_e4m3(", "int pick3(",
    "void q8s_dot(", "void nvfp4_dot(", "float e2m1_f32(", "float q8s_elem(", "float nvfp4_elem("]))
(out / "q4k_extract.h").write_text("".join(extract(n) for n in [
    "float sb_byte_f32(", "u32 q4k_scale_byte(", "void q4k_scale_min(", "void q4ks_dot(", "float q4ks_elem(",
    "void scale_min_k4("]) + fwd + extract("void dequant_unit<TY_Q4_K>("))
(out / "q5_extract.h").write_text("".join(extract(n) for n in [
    "float sb_byte_f32(", "void q5s_dot(", "float q5s_elem("]) + fwd + extract("void dequant_unit<TY_Q5_0>(")
    + macro("Q5S_ROW_PTRS"))
(out / "q6k_extract.h").write_text("".join(extract(n) for n in [
    "float sb_byte_f32(", "void q6ks_dot(", "float q6ks_elem("]) + fwd + extract("void dequant_unit<TY_Q6_K>(")
    + macro("Q6S_ROW_PTRS"))
(out / "mvv_extract.h").write_text("".join(extract(n) for n in [
    "float sb_byte_f32(", "void sb_q8x4(", "struct MvvRows", "const u8* mvv_q(", "const u8* mvv_m(", "T mvv_ld(",
    "void q8s_load16(", "void q8s_compute16(", "void q8s_dot16(", "float q4v_nib_dot(", "void q4ks_dot16(", "u32 q4k_scale_byte(", "void q4k_scale_min(",
    "float q4ks_elem(", "float q8s_elem("]).replace("int qs, ms, last;\n}", "int qs, ms, last;\n};"))

(out / "norm_extract.h").write_text(macro_line("NORM_VEC") + "".join(extract(n) for n in [
    "float norm_warp_sum(", "float norm_block_sum(", "void rms_norm_row_by(", "void rms_norm_row(", "void sb_stage_x("]))
(out / "attend_extract.h").write_text(macro_line("ATT_THREADS") + macro_line("ATT_TILE") + macro_line("ATT_KB")
    + macro_line("ATT_HD_LANE") + macro_line("ATT_VB") + "".join(extract(n) for n in [
        "int att_chunk(", "void kv_store(float*", "void kv_store(u16*", "float kv_round(const float*", "float kv_round(const u16*",
        "void rope_angle(", "void rope_turn(", "void rope_rotate(", "void rope_store(", "struct AttIdx",
        "AttIdx att_grid_idx(", "struct AttPre", "void att_load_keys(", "void att_load_values(", "void att_preload(",
        "void attend_part_with(", "void attend_part(", "float att_in(", "void attend_rope_part("])
    .replace("float vx[ATT_VB];\n}", "float vx[ATT_VB];\n};")
    .replace("int row, head, split, n_split;\n}", "int row, head, split, n_split;\n};"))

# Phase 1 of the fused Q8_0 FFN (superblock.cu) with the helpers it calls.
(out / "ffn_p1_extract.h").write_text((macro_line("SB_WARPS") + macro_line("SB_THREADS") + macro_line("SB_PAGE_CH")
    + macro_line("SB_P1_VECS") + macro_line("SB_P1B_UNITS") + macro_line("SB_MAGIC") + macro_line("NORM_VEC")
    + "".join(extract(n) for n in [
        "float sb_warp_sum(", "float sb_byte_f32(", "void sb_q8x4(", "float sb_q8_dot4(",
        "float norm_warp_sum(", "float norm_block_sum(", "void rms_norm_row_by(", "void rms_norm_row(", "void sb_stage_x(",
        "struct SbQ8sRows", "SbQ8sRows sb_q8s_rows(", "void sb_q8s_round(", "void sb_ffn_q8s_phase1("]))
    .replace("bool on;\n}", "bool on;\n};"))

# Phase 2 of the fused Q8_0 FFN (superblock.cu) with the helpers it calls.
(out / "ffn_p2_extract.h").write_text(macro_line("SB_WARPS") + macro_line("SB_THREADS") + macro_line("SB_PAGE_CH")
    + macro_line("SB_P2_QUADS") + macro_line("SB_MAGIC")
    + "".join(extract(n) for n in ["float sb_byte_f32(", "void sb_q8x4(", "void nv_reduce_scatter(",
        "void sb_q8x16_axpy(", "void sb_q8s_p2_quads(", "void sb_sum_chunk_parts(", "void sb_finish_item(",
        "void sb_ffn_q8s_phase2("]))


def macro_block(name):
    """`#define name ...` with its continuation lines (ending in a backslash)."""
    i = src.index("#define " + name)
    j = i
    while True:
        e = src.index("\n", j)
        if not src[j:e].rstrip().endswith("\\"):
            return src[i : e + 1]
        j = e + 1


# The attention block kernel (dense.cu's attn_block: Q/K/V, the decode
# attention and O in one persistent grid) with everything it calls: the
# split Q8_0 mat-vec helpers, the folded norm, the attention. The counter
# load's PTX (attb_load_acquire) and the copy engine (sb_tx_*, sb_bulk_g2s)
# are check_attn_block.cpp's stand-ins; mv3_grid comes along as the
# reference's Q/K/V and O launches.
(out / "attn_block_extract.h").write_text(
    "".join(macro_line(m) for m in ["FAST_WARPS", "FAST_ROWS", "MVV_Q8", "MVV_Q4K", "MVV2_NR", "MVV2_U_Q8",
                                    "ATT_THREADS", "ATT_TILE", "ATT_KB", "ATT_HD_LANE", "ATT_VB", "NORM_VEC",
                                    "ATTB_THREADS", "ATTB_SYNC", "ATTB_WAIT_CYCLES"])
    + "".join(macro_block(m) for m in ["MV3_PARAMS", "MV3_ARGS", "FAST_INPUT", "MV3_MATRIX", "ATTB_PARAMS",
                                       "ATTB_ARGS", "ATTB_SPLIT"])
    + ("".join(extract(n) for n in [
        "float norm_warp_sum(", "float norm_block_sum(", "void rms_norm_row_by(", "void rms_norm_row(",
        "float warp_sum(", "float warp_max(", "float sb_byte_f32(", "void sb_q8x4(", "int pick3(", "void mv_store(",
        "const float* norm_prologue(", "struct MvvRows", "const u8* mvv_q(", "const u8* mvv_m(", "T mvv_ld(",
        "void q8s_load16(", "void q8s_compute16(", "void q8s_dot16(", "float q4v_nib_dot(", "void q4ks_dot16(",
        "void mvv_dot(", "int mvv_qrow(", "int mvv_mrow(", "void mv3_store(", "void mv3_slice(",
        "MvvRows mv3_rows(", "void mv3_tile_loop(", "void mv3_grid(",
        "int att_chunk(", "void kv_store(float*", "void kv_store(u16*", "float kv_round(const float*",
        "float kv_round(const u16*", "void rope_angle(", "void rope_turn(", "struct AttIdx", "AttIdx att_grid_idx(",
        "struct AttPre", "void att_load_keys(", "void att_load_values(", "void att_preload(",
        "void attend_part_with(", "float att_in(", "void attend_rope_part(", "float attend_merge(",
        "bool attend_then_merge(",
        "void attb_wait(", "void attb_signal(", "unsigned attb_tiles_of(", "void attb_qkv(", "void attb_o(",
        "void attn_block("])
       .replace("int qs, ms, last;\n}", "int qs, ms, last;\n};")
       .replace("float vx[ATT_VB];\n}", "float vx[ATT_VB];\n};")
       .replace("int row, head, split, n_split;\n}", "int row, head, split, n_split;\n};")))
