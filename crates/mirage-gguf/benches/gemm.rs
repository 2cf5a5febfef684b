//! Matrix products on one thread, at the shapes of the real models'
//! matrices. Prefill: each GEMM kernel this CPU runs (on activations packed
//! once) against the single-row dot kernel once per (row, token), in GMAC/s
//! (multiply-accumulates per second), plus the activation packing cost.
//! Decode: the single-row dot kernel per row against the type's
//! matrix-vector kernel on L2-resident rows, in GB/s of weights (the rate
//! one core can unpack them at; decode is memory-bound only while this is
//! well above the machine's memory bandwidth per core).
//!
//! `cargo bench -p mirage-gguf --bench gemm [-- --tokens 128]` prints one
//! table (median of 5 samples of at least 0.1 s each, timed in thread CPU
//! time so that other processes on a shared machine count less).

use std::hint::black_box;

use mirage_gguf::quant::{
    dot_fn, gemm_input_type, pack_rows, packed_bytes, quantize, row_bytes, vec_dot_type, GemmIsa,
};
use mirage_gguf::GgmlType::{self, *};

/// (type, rows, cols, what) — Qwen2.5-Coder-1.5B and -0.5B Q4_K_M matrices.
const SHAPES: [(GgmlType, usize, usize, &str); 8] = [
    (Q4_K, 1536, 1536, "1.5B attn_q/o"),
    (Q4_K, 8960, 1536, "1.5B ffn_gate/up"),
    (Q6_K, 1536, 8960, "1.5B ffn_down (Q6_K)"),
    (Q4_K, 1536, 8960, "1.5B ffn_down (Q4_K)"),
    (Q5_K, 1536, 1536, "Q5_K_M attn"),
    (Q5_0, 4864, 896, "0.5B ffn_gate/up"),
    (Q6_K, 896, 4864, "0.5B ffn_down"),
    (Q8_0, 128, 896, "0.5B attn_v"),
];

fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        })
        .collect()
}

fn quantized(ty: GgmlType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
    let rb = row_bytes(ty, cols).unwrap();
    // 64 distinct rows tiled (the K-quant reference quantizers are slow).
    let distinct = rows.min(64);
    let mut chunk = vec![0u8; distinct * rb];
    quantize(ty, &values(distinct * cols, seed), &mut chunk).unwrap();
    let mut out = Vec::with_capacity(rows * rb);
    while out.len() < rows * rb {
        let take = (rows * rb - out.len()).min(chunk.len());
        out.extend_from_slice(&chunk[..take]);
    }
    out
}

/// This thread's CPU time in seconds: on a shared machine the wall clock
/// also counts the time other processes hold the core.
fn thread_cpu_secs() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid out pointer; CLOCK_THREAD_CPUTIME_ID exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// Thread CPU seconds per call of `f`: the median of 5 samples, each
/// calling `f` until at least 0.1 s have passed (the thread clock of a
/// virtual machine may advance only at scheduler ticks), after a warm-up.
fn median_secs(mut f: impl FnMut()) -> f64 {
    f();
    let mut t: Vec<f64> = (0..5)
        .map(|_| {
            // Doubling batches between clock reads: reading the thread
            // clock is a system call, too slow to do per short call.
            let s = thread_cpu_secs();
            let (mut calls, mut batch) = (0u64, 1u64);
            loop {
                for _ in 0..batch {
                    f();
                }
                calls += batch;
                batch *= 2;
                let dt = thread_cpu_secs() - s;
                if dt >= 0.1 {
                    return dt / calls as f64;
                }
            }
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[2]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let n = args
        .iter()
        .position(|a| a == "--tokens")
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(128usize);
    println!("one thread, {n} tokens; GMAC/s of thread CPU time");
    println!("| matrix | type | rows x cols | single-row dot | scalar gemm | avx2 gemm | vnni gemm | pack ms | decode GB/s: row dot | matvec |");
    println!("|---|---|---|---:|---:|---:|---:|---:|---:|---:|");
    for (ty, rows, cols, what) in SHAPES {
        let w = quantized(ty, rows, cols, 1);
        let act_ty = gemm_input_type(ty).unwrap();
        assert_eq!(act_ty, vec_dot_type(ty));
        let ab = row_bytes(act_ty, cols).unwrap();
        let mut act = vec![0u8; n * ab];
        quantize(act_ty, &values(n * cols, 2), &mut act).unwrap();
        let mut packed = vec![0u8; packed_bytes(ty, n, cols).unwrap()];
        let pack = median_secs(|| pack_rows(ty, &act, ab, n, cols, &mut packed).unwrap());
        let macs = (rows * cols * n) as f64;
        let mut out = vec![0f32; rows * n];
        let wb = row_bytes(ty, cols).unwrap();
        let dot = dot_fn(ty).unwrap();
        // The single-row path on a slice of the rows (it is slow).
        let rows_dot = rows.min(64);
        let single = median_secs(|| {
            for r in 0..rows_dot {
                for t in 0..n {
                    // SAFETY: lengths built above.
                    out[r * n + t] =
                        unsafe { dot(cols, &w[r * wb..(r + 1) * wb], &act[t * ab..(t + 1) * ab]) };
                }
            }
        });
        let mut cells = vec![format!(
            "{:.1}",
            (rows_dot * cols * n) as f64 / single / 1e9
        )];
        for isa in GemmIsa::ALL {
            if !isa.available() || (isa == GemmIsa::Scalar) {
                cells.push("-".into());
                continue;
            }
            let s = median_secs(|| {
                isa.gemm(ty, cols, black_box(&w), rows, &packed, n, &mut out)
                    .unwrap()
            });
            cells.push(format!("{:.1}", macs / s / 1e9));
        }
        // Decode: one activation row against the first rows of the
        // matrix, at most 256 KiB of them (L2-resident, repeated), so that
        // the rate is the kernel's, not the memory's.
        let a1 = &act[..ab];
        let mrows = (256 * 1024 / wb).clamp(1, rows);
        let wm = &w[..mrows * wb];
        let row_dot = median_secs(|| {
            for r in 0..mrows {
                // SAFETY: lengths built above.
                out[r] = unsafe { dot(cols, &wm[r * wb..(r + 1) * wb], black_box(a1)) };
            }
        });
        let gbs = |s: f64| format!("{:.1}", wm.len() as f64 / s / 1e9);
        let matvec = match GemmIsa::best().matvec_kernel(ty) {
            Some(_) => gbs(median_secs(|| {
                GemmIsa::best()
                    .matvec(ty, cols, black_box(wm), mrows, a1, &mut out[..mrows])
                    .unwrap()
            })),
            None => "-".into(),
        };
        println!(
            "| {what} | {ty} | {rows} x {cols} | {} | {:.2} | {} | {matvec} |",
            cells.join(" | "),
            pack * 1e3,
            gbs(row_dot)
        );
    }
}
