//! What skipping channel runs saves at the memory alone: reads 1 GiB laid
//! out as the channel-major kernels read it (groups of 32 channels, each
//! channel a run of RUN bytes, the group's runs walked side by side 64
//! bytes at a time, the kernel's software prefetch 8 steps ahead), keeping
//! KEEP percent of the runs, and prints its time against one sequential
//! read of every byte. No arithmetic: the difference is the memory system's.
//! `cargo run --release -p mirage-gguf --example run_reads [RUN_BYTES [KEEP_PERCENT...]]`
//! (defaults 1024 and 100 90 50 25).

use std::time::Instant;

/// Channels walked side by side (the kernels' group).
const GROUP: usize = 32;
/// Steps of 64 bytes the prefetch runs ahead (the kernels' distance).
const AHEAD: usize = 8;

#[cfg(target_arch = "x86_64")]
fn prefetch(p: *const u8) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T2};
    // SAFETY: a prefetch has no architectural effect and never faults.
    unsafe { _mm_prefetch::<_MM_HINT_T2>(p as *const i8) };
}

#[cfg(not(target_arch = "x86_64"))]
fn prefetch(_: *const u8) {}

/// The first 8 bytes of each 64-byte step summed (one load a line, so the
/// time is the memory's).
fn line_sum(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let run: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(1024);
    let run = run.next_multiple_of(64).max(64);
    let mut keeps: Vec<u32> = args[2.min(args.len())..]
        .iter()
        .filter_map(|s| s.parse().ok())
        .collect();
    if keeps.is_empty() {
        keeps = vec![100, 90, 50, 25];
    }
    let group_bytes = run * GROUP;
    let groups = (1usize << 30) / group_bytes;
    let buf: Vec<u8> = (0..groups * group_bytes).map(|i| i as u8).collect();
    let steps = run / 64;
    let sequential = || {
        let t = Instant::now();
        let mut s = 0u64;
        for at in (0..buf.len()).step_by(64) {
            prefetch(buf.as_ptr().wrapping_add(at + 2048));
            s = s.wrapping_add(line_sum(&buf, at));
        }
        std::hint::black_box(s);
        t.elapsed().as_secs_f64()
    };
    for keep in keeps {
        // Channel c of group g is read when a hash of (g, c) falls under KEEP.
        let active: Vec<Vec<usize>> = (0..groups)
            .map(|g| {
                (0..GROUP)
                    .filter(|c| ((g * GROUP + c).wrapping_mul(2654435761) % 100) < keep as usize)
                    .collect()
            })
            .collect();
        let read: usize = active.iter().map(|a| a.len() * run).sum();
        let (mut best_side, mut best_seq) = (f64::INFINITY, f64::INFINITY);
        for _ in 0..3 {
            let t = Instant::now();
            let mut s = 0u64;
            for (g, chans) in active.iter().enumerate() {
                let base = g * group_bytes;
                for b in 0..steps {
                    for &c in chans {
                        let ahead = b + AHEAD;
                        let p = if ahead < steps {
                            base + c * run + ahead * 64
                        } else {
                            base + group_bytes + c * run + (ahead - steps) * 64
                        };
                        prefetch(buf.as_ptr().wrapping_add(p));
                        s = s.wrapping_add(line_sum(&buf, base + c * run + b * 64));
                    }
                }
            }
            std::hint::black_box(s);
            best_side = best_side.min(t.elapsed().as_secs_f64());
            best_seq = best_seq.min(sequential());
        }
        println!(
            "runs of {run} B, keep {keep:3} %: {:.2}x the time of one sequential read of all \
             ({:.1} GB/s of the bytes read; sequential {:.1} GB/s)",
            best_side / best_seq,
            read as f64 / best_side / 1e9,
            buf.len() as f64 / best_seq / 1e9
        );
    }
}
