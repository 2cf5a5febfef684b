//! Codec throughput on a 4096x4096-element tensor of every type, in GB/s of
//! quantized bytes: dequantize to f32, a matvec with the runtime's dot kernel
//! (`dot_fn`, one call per row), and a memcpy of the same bytes for scale.
//!
//! `cargo bench -p mirage-gguf --bench quant` runs criterion (1 s per item)
//! and then prints a summary table from its own timing (median of 7 runs).

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput};
use mirage_gguf::quant::{dequantize, dot_fn, quantize, row_bytes, simd_dot_fn, vec_dot_type};
use mirage_gguf::GgmlType::{self, *};

const ROWS: usize = 4096;
const COLS: usize = 4096;
const TYPES: [GgmlType; 14] = [
    F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K,
];

struct Case {
    ty: GgmlType,
    weights: Vec<u8>,
    act: Vec<u8>,
}

fn pseudo_normal(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            // Sum of 4 uniforms: cheap, bell-shaped, deterministic.
            let mut acc = 0f32;
            for _ in 0..4 {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                acc += (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            }
            acc
        })
        .collect()
}

fn make_case(ty: GgmlType) -> Case {
    // Quantize 256 rows and tile them: the K-quant reference quantizers are
    // too slow to run over 16M elements per type.
    let chunk_rows = 256;
    let x = pseudo_normal(chunk_rows * COLS, 1);
    let mut chunk = vec![0u8; row_bytes(ty, x.len()).unwrap()];
    quantize(ty, &x, &mut chunk).unwrap();
    let mut weights = Vec::with_capacity(chunk.len() * ROWS / chunk_rows);
    for _ in 0..ROWS / chunk_rows {
        weights.extend_from_slice(&chunk);
    }
    let act_ty = vec_dot_type(ty);
    let a = pseudo_normal(COLS, 2);
    let mut act = vec![0u8; row_bytes(act_ty, COLS).unwrap()];
    quantize(act_ty, &a, &mut act).unwrap();
    Case { ty, weights, act }
}

fn matvec(case: &Case, out: &mut [f32]) {
    let kernel = dot_fn(case.ty).expect("every type has a kernel");
    let row = case.weights.len() / ROWS;
    for (r, o) in out.iter_mut().enumerate() {
        // SAFETY: every row holds COLS elements of ty; act holds COLS of vec_dot_type(ty).
        *o = unsafe { kernel(COLS, &case.weights[r * row..(r + 1) * row], &case.act) };
    }
}

fn median_secs(mut f: impl FnMut()) -> f64 {
    f();
    let mut t: Vec<f64> = (0..7)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(|a, b| a.partial_cmp(b).unwrap());
    t[3]
}

fn main() {
    let mut c = Criterion::default()
        .measurement_time(Duration::from_secs(1))
        .warm_up_time(Duration::from_millis(300))
        .sample_size(10)
        .configure_from_args();
    let cases: Vec<Case> = TYPES.iter().map(|t| make_case(*t)).collect();
    let mut f32_out = vec![0f32; ROWS * COLS];
    let mut rows_out = vec![0f32; ROWS];
    let mut table = Vec::new();
    for case in &cases {
        let bytes = case.weights.len();
        let mut copy = vec![0u8; bytes];
        let mut g = c.benchmark_group(case.ty.name());
        g.throughput(Throughput::Bytes(bytes as u64));
        g.bench_function("dequantize", |b| {
            b.iter(|| dequantize(case.ty, black_box(&case.weights), &mut f32_out).unwrap())
        });
        g.bench_function("matvec_dot", |b| {
            b.iter(|| matvec(black_box(case), &mut rows_out))
        });
        g.bench_function("memcpy", |b| {
            b.iter(|| copy.copy_from_slice(black_box(&case.weights)))
        });
        g.finish();

        let gbs = |s: f64| bytes as f64 / s / 1e9;
        let deq =
            median_secs(|| dequantize(case.ty, black_box(&case.weights), &mut f32_out).unwrap());
        let dot = median_secs(|| matvec(black_box(case), &mut rows_out));
        let cpy = median_secs(|| copy.copy_from_slice(black_box(&case.weights)));
        table.push((
            case.ty,
            bytes,
            gbs(deq),
            gbs(dot),
            gbs(cpy),
            simd_dot_fn(case.ty).is_some(),
        ));
    }
    c.final_summary();
    println!("\n4096x4096 elements; GB/s of quantized bytes (median of 7 runs)");
    println!(
        "{:<6} {:>9} {:>12} {:>12} {:>9} {:>6}",
        "type", "MiB", "dequantize", "matvec dot", "memcpy", "simd"
    );
    for (ty, bytes, deq, dot, cpy, simd) in table {
        println!(
            "{:<6} {:>9.1} {:>12.2} {:>12.2} {:>9.2} {:>6}",
            ty.to_string(),
            bytes as f64 / (1 << 20) as f64,
            deq,
            dot,
            cpy,
            if simd { "avx2" } else { "scalar" }
        );
    }
}
