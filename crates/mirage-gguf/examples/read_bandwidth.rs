//! Memory read and copy bandwidth of this machine with N threads, on a
//! buffer far beyond the caches: the ceiling a bandwidth-bound decode step
//! runs against.
//! `cargo run --release -p mirage-gguf --example read_bandwidth [THREADS] [MIB]`.

use std::time::Instant;

/// Sum of every 8-byte word (the compiler vectorizes it), so no load is
/// optimised away.
fn read_sum(b: &[u64]) -> u64 {
    let mut acc = [0u64; 8];
    for c in b.chunks_exact(8) {
        for k in 0..8 {
            acc[k] = acc[k].wrapping_add(c[k]);
        }
    }
    acc.iter().fold(0, |a, b| a.wrapping_add(*b))
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let threads: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(2);
    let mib: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(1024);
    let words = (mib << 20) / 8;
    let src: Vec<u64> = (0..words as u64).map(|i| i.wrapping_mul(0x9e37)).collect();
    let mut dst = vec![0u64; words];
    let per = words.div_ceil(threads);
    let mut reads = Vec::new();
    let mut copies = Vec::new();
    for _ in 0..7 {
        let t = Instant::now();
        let sum: u64 = std::thread::scope(|s| {
            let hs: Vec<_> = src
                .chunks(per)
                .map(|c| s.spawn(move || read_sum(c)))
                .collect();
            hs.into_iter()
                .map(|h| h.join().expect("reader"))
                .fold(0, u64::wrapping_add)
        });
        reads.push((mib as f64 * 1.048576e-3) / t.elapsed().as_secs_f64());
        std::hint::black_box(sum);
        let t = Instant::now();
        std::thread::scope(|s| {
            for (d, c) in dst.chunks_mut(per).zip(src.chunks(per)) {
                s.spawn(move || d.copy_from_slice(c));
            }
        });
        // A copy moves each byte twice (read and write).
        copies.push(2.0 * (mib as f64 * 1.048576e-3) / t.elapsed().as_secs_f64());
        std::hint::black_box(&dst);
    }
    let med = |v: &mut Vec<f64>| {
        v.sort_by(|a, b| a.total_cmp(b));
        (v[v.len() / 2], v[v.len() - 1])
    };
    let (rm, rb) = med(&mut reads);
    let (cm, cb) = med(&mut copies);
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "{threads} threads, {mib} MiB: read {rm:.1} GB/s (best {rb:.1}), copy {cm:.1} GB/s read+write (best {cb:.1}) | load {}",
        load.split_whitespace().take(3).collect::<Vec<_>>().join(" ")
    );
}
