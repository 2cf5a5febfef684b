//! Single-thread speed of the channel-major tile kernels against the dense
//! row-major dot kernels on one matrix (random weights, out of cache):
//! `cargo run --release -p mirage-gguf --example channel_major_bench [TYPE ROWS COLS]`.

use std::time::Instant;

use mirage_gguf::quant::channel_major::{ActiveChannels, ChannelMajorKernel, ChannelMajorLayout};
use mirage_gguf::quant::{self};
use mirage_gguf::GgmlType;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let ty = match args.get(1).map(|s| s.as_str()).unwrap_or("q4_k") {
        "q4_0" => GgmlType::Q4_0,
        "q4_1" => GgmlType::Q4_1,
        "q5_0" => GgmlType::Q5_0,
        "q8_0" => GgmlType::Q8_0,
        "q6_k" => GgmlType::Q6_K,
        _ => GgmlType::Q4_K,
    };
    let rows: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(8960);
    let cols: usize = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(1536);
    // Several copies so that the working set is far beyond the caches.
    let copies = (512usize << 20) / (rows * cols / 2).max(1);
    let copies = copies.clamp(2, 64);
    let rb = quant::row_bytes(ty, cols).unwrap();
    let mut s = 1u64;
    let vals: Vec<f32> = (0..rows * cols)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect();
    let mut src = vec![0u8; rb * rows];
    quant::quantize(ty, &vals, &mut src).unwrap();
    let layout = ChannelMajorLayout::new(ty, rows, cols).unwrap();
    let mut cm = vec![0u8; layout.bytes()];
    quant::channel_major::repack(&layout, &src, &mut cm).unwrap();
    let dense: Vec<Vec<u8>> = (0..copies).map(|_| src.clone()).collect();
    let cms: Vec<Vec<u8>> = (0..copies).map(|_| cm.clone()).collect();
    let x: Vec<f32> = vals[..cols].to_vec();
    let at = quant::vec_dot_type(ty);
    let mut xq = vec![0u8; quant::row_bytes(at, cols).unwrap()];
    quant::quantize(at, &x, &mut xq).unwrap();
    let dot = quant::dot_fn(ty).unwrap();
    let mut y = vec![0f32; rows];
    let iters = 3 * copies;
    let t = Instant::now();
    for it in 0..iters {
        let w = &dense[it % copies];
        for r in 0..rows {
            y[r] = unsafe { dot(cols, &w[r * rb..(r + 1) * rb], &xq) };
        }
    }
    let dt = t.elapsed().as_secs_f64() / iters as f64;
    println!(
        "{ty} {rows}x{cols}: dense row dot {:.3} ms, {:.1} GB/s",
        dt * 1e3,
        src.len() as f64 / dt / 1e9
    );
    for fam in ChannelMajorKernel::available() {
        let k = fam.kernel(ty).unwrap();
        for keep in [1.0f32, 0.5, 0.25] {
            let mut act = ActiveChannels::default();
            act.fill(&x, layout.group(), |i, _| {
                ((i.wrapping_mul(2654435761)) % 1000) as f32 / 1000.0 < keep
            });
            let bytes = layout.bytes_read(&act);
            let mut out = vec![0f32; layout.tile()];
            let t = Instant::now();
            let it2 = if fam == ChannelMajorKernel::Scalar {
                1
            } else {
                iters
            };
            for it in 0..it2 {
                let w = &cms[it % copies];
                for tt in 0..layout.n_tiles() {
                    unsafe { k(&layout, w, tt, 0..layout.n_groups(), &act, &mut out) };
                }
            }
            let dt = t.elapsed().as_secs_f64() / it2 as f64;
            println!(
                "  {:<7} keep {keep:.2}: {:.3} ms, {:.1} GB/s of bytes read",
                fam.name(),
                dt * 1e3,
                bytes as f64 / dt / 1e9
            );
        }
    }
}
