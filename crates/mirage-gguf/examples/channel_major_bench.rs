//! Speed of the channel-major tile kernels against the dense
//! row-major dot kernels on one matrix (random weights, out of cache),
//! alternating in rounds so that machine load hits them alike (the dense
//! baseline: the decode matrix-vector kernel of the type); prints per
//! configuration the best round and the median over rounds of its speed-up
//! against the dense pass of the same round:
//! `cargo run --release -p mirage-gguf --example channel_major_bench [TYPE ROWS COLS [TILE [ROUNDS [COPIES [THREADS]]]]]`
//! (TILE or COPIES 0: the default; one copy of a small matrix: the kernels'
//! speed in cache; the copies in huge-page memory, as the CPU backends hold
//! a model's weights; THREADS > 1:
//! that many threads, each on other copies, as the decode's threads share
//! the memory; times are per matrix).

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
        "q5_k" => GgmlType::Q5_K,
        "q8_0" => GgmlType::Q8_0,
        "q6_k" => GgmlType::Q6_K,
        _ => GgmlType::Q4_K,
    };
    let rows: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(8960);
    let cols: usize = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(1536);
    let layout = match args.get(4).and_then(|s| s.parse().ok()).filter(|&t| t > 0) {
        Some(tile) => ChannelMajorLayout::with_tile(ty, rows, cols, tile).unwrap(),
        None => ChannelMajorLayout::new(ty, rows, cols).unwrap(),
    };
    let rounds: usize = args.get(5).and_then(|s| s.parse().ok()).unwrap_or(5);
    // Several copies so that the working set is far beyond the caches (1 GiB
    // of each layout: some servers have an L3 of several hundred MiB).
    let copies = args
        .get(6)
        .and_then(|s| s.parse().ok())
        .filter(|&c: &usize| c > 0)
        .unwrap_or(((1usize << 30) / (rows * cols / 2).max(1)).clamp(2, 256));
    let threads: usize = args.get(7).and_then(|s| s.parse().ok()).unwrap_or(1).max(1);
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
    let mut cm = vec![0u8; layout.bytes()];
    quant::channel_major::repack(&layout, &src, &mut cm).unwrap();
    let dense_copies = copies_in_huge_pages(&src, copies);
    let cm_copies = copies_in_huge_pages(&cm, copies);
    let dense: Vec<&[u8]> = dense_copies.iter().collect();
    let cms: Vec<&[u8]> = cm_copies.iter().collect();
    let x: Vec<f32> = vals[..cols].to_vec();
    let at = quant::vec_dot_type(ty);
    let mut xq = vec![0u8; quant::row_bytes(at, cols).unwrap()];
    quant::quantize(at, &x, &mut xq).unwrap();
    let dot = quant::dot_fn(ty).unwrap();
    let fam = ChannelMajorKernel::best();
    let k = fam.kernel(ty).unwrap();
    let keeps = [1.0f32, 0.9, 0.5, 0.25];
    let matvec = quant::GemmIsa::best().matvec_kernel(ty);
    let acts: Vec<ActiveChannels> = keeps
        .iter()
        .map(|&keep| {
            let mut act = ActiveChannels::default();
            act.fill(&x, layout.group(), |i, _| {
                ((i.wrapping_mul(2654435761)) % 1000) as f32 / 1000.0 < keep
            });
            act
        })
        .collect();
    let out_len = layout.tile().min(rows);
    let iters = (2 * copies).max(64);
    // Seconds per iteration of `f(iteration, buffer)` over `iters`
    // iterations spread over `threads` threads (each its own buffer of
    // `len` floats).
    let timed = |len: usize, f: &(dyn Fn(usize, &mut [f32]) + Sync)| -> f64 {
        let t = Instant::now();
        std::thread::scope(|s| {
            for j in 0..threads {
                s.spawn(move || {
                    let mut buf = vec![0f32; len];
                    for it in (j..iters).step_by(threads) {
                        f(it, &mut buf);
                    }
                });
            }
        });
        t.elapsed().as_secs_f64() / iters as f64
    };
    let mut best = vec![f64::INFINITY; 1 + keeps.len()];
    let mut ratios = vec![Vec::new(); keeps.len()];
    let mut best_dot = f64::INFINITY;
    for _ in 0..rounds {
        let dot_t = timed(rows, &|it, y| {
            let w = &dense[it % copies];
            for r in 0..rows {
                // SAFETY: rows of `cols` elements of `ty`; `xq` its vec_dot_type.
                y[r] = unsafe { dot(cols, &w[r * rb..(r + 1) * rb], &xq) };
            }
        });
        best_dot = best_dot.min(dot_t);
        let dense_t = match matvec {
            Some(mv) => timed(rows, &|it, y| {
                let w = &dense[it % copies];
                // SAFETY: `rows` rows of `cols` elements of `ty`; `xq`
                // one row of its vec_dot_type; `y` holds `rows`.
                unsafe { mv(cols, w, rows, &xq, y) };
            }),
            None => dot_t,
        };
        best[0] = best[0].min(dense_t);
        for (c, act) in acts.iter().enumerate() {
            let el = timed(out_len, &|it, out| {
                let w = &cms[it % copies];
                for tt in 0..layout.n_tiles() {
                    let r = layout.tile_rows(tt);
                    // SAFETY: the layout's bytes, tile and groups in range,
                    // `act` built over `cols` with the layout's group.
                    unsafe { k(&layout, w, tt, 0..layout.n_groups(), act, &mut out[..r]) };
                }
            });
            best[c + 1] = best[c + 1].min(el);
            ratios[c].push(dense_t / el);
        }
    }
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "{ty} {rows}x{cols} (tile {}), {threads} thread(s), best of {rounds} rounds, load {}",
        layout.tile(),
        load.split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    );
    println!(
        "  dense row dot       {:.3} ms, {:.1} GB/s",
        best_dot * 1e3,
        src.len() as f64 / best_dot / 1e9
    );
    println!(
        "  dense matvec        {:.3} ms, {:.1} GB/s (the baseline of the ratios below)",
        best[0] * 1e3,
        src.len() as f64 / best[0] / 1e9
    );
    for (c, keep) in keeps.iter().enumerate() {
        let bytes = layout.bytes_read(&acts[c]);
        println!(
            "  {} keep {keep:.2}: {:.3} ms, {:.1} GB/s of bytes read, {:.2}x dense (median of per-round ratios)",
            fam.name(),
            best[c + 1] * 1e3,
            bytes as f64 / best[c + 1] / 1e9,
            {
                let r = &mut ratios[c];
                r.sort_by(|a, b| a.total_cmp(b));
                r[r.len() / 2]
            }
        );
    }
}

/// `copies` copies of `bytes` in anonymous memory advised for huge pages, as
/// the CPU backends hold a model's weights (`mirage_gguf::resident`).
struct Copies {
    map: memmap2::MmapMut,
    stride: usize,
    len: usize,
    n: usize,
}

impl Copies {
    fn iter(&self) -> impl Iterator<Item = &[u8]> {
        (0..self.n).map(|i| &self.map[i * self.stride..i * self.stride + self.len])
    }
}

fn copies_in_huge_pages(bytes: &[u8], n: usize) -> Copies {
    let stride = bytes.len().next_multiple_of(4096);
    let mut map = memmap2::MmapOptions::new()
        .len((stride * n).max(1))
        .map_anon()
        .unwrap();
    #[cfg(target_os = "linux")]
    map.advise(memmap2::Advice::HugePage).unwrap();
    for i in 0..n {
        map[i * stride..i * stride + bytes.len()].copy_from_slice(bytes);
    }
    Copies {
        map,
        stride,
        len: bytes.len(),
        n,
    }
}
