//! pruned-attention-bench: decode attention time per token, full (dense.cu's
//! split-K over every position) against pruned (page boxes refreshed for the
//! new position's page, pages chosen on the device, split-K over the chosen
//! pages), over every layer of a model shape, at several context lengths.
//! Random keys and values (f16 KV cache, one distinct cache per layer so the
//! L2 does not hold them all); one query row (batch 1 decode).
//!
//! Attention only: the rest of a decode step (mat-vecs, norms) is not in
//! these numbers. Wall time of `--iters` tokens after a warm-up, launches
//! included (the backend's CUDA graphs would hide most launch cost).
//!
//! Usage: `pruned-attention-bench [--contexts 4096,8192,16384,32768]
//! [--layers 24 --heads 14 --kv-heads 2 --head-dim 64] [--iters 50]
//! [--prune top=8,...]...` (the default shape is Qwen2.5-0.5B's). Prints a
//! table last: per pruning setting, ms/token, speedup over full, positions
//! kept and ("choice") the ms/token of the page choice alone.

#[cfg(not(feature = "cuda"))]
fn main() {
    eprintln!("pruned-attention-bench: built without the `cuda` feature");
    std::process::exit(2);
}

#[cfg(feature = "cuda")]
fn main() {
    if let Err(e) = bench::run() {
        eprintln!("pruned-attention-bench: {e}");
        std::process::exit(1);
    }
}

#[cfg(feature = "cuda")]
mod bench {
    use std::error::Error;
    use std::time::Instant;

    use mirage_cuda::kv_pruning::{LayerKvShape, PrunedAttention};
    use mirage_runtime::{KvDtype, KvPruning};

    struct Args {
        contexts: Vec<usize>,
        layers: usize,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        iters: usize,
        prunes: Vec<KvPruning>,
    }

    fn parse() -> Result<Args, Box<dyn Error>> {
        let mut a = Args {
            contexts: vec![4096, 8192, 16384, 32768],
            layers: 24,
            heads: 14,
            kv_heads: 2,
            head_dim: 64,
            iters: 50,
            prunes: Vec::new(),
        };
        let mut it = std::env::args().skip(1);
        while let Some(flag) = it.next() {
            let mut val = || it.next().ok_or_else(|| format!("{flag} needs a value"));
            match flag.as_str() {
                "--contexts" => {
                    a.contexts = val()?
                        .split(',')
                        .map(|s| s.trim().parse())
                        .collect::<Result<_, _>>()?
                }
                "--layers" => a.layers = val()?.parse()?,
                "--heads" => a.heads = val()?.parse()?,
                "--kv-heads" => a.kv_heads = val()?.parse()?,
                "--head-dim" => a.head_dim = val()?.parse()?,
                "--iters" => a.iters = val()?.parse()?,
                "--prune" => a.prunes.push(val()?.parse()?),
                other => return Err(format!("unknown flag {other}").into()),
            }
        }
        if a.prunes.is_empty() {
            // The CPU run's setting (16-position pages, 44 of them) and the
            // same with a budget growing with the context (10 % of pages).
            a.prunes = vec![
                "page=16,sinks=4,recent=8,top=32".parse()?,
                "page=16,sinks=4,recent=8,top=32,top_percent=10".parse()?,
            ];
        }
        if a.prunes.iter().any(|c| c.page != a.prunes[0].page) {
            return Err("every --prune needs the same page size (one cache layout per run)".into());
        }
        Ok(a)
    }

    /// xorshift: fast enough for hundreds of millions of values.
    fn fill(seed: u64, n: usize) -> Vec<f32> {
        let mut s = seed | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
            })
            .collect()
    }

    pub fn run() -> Result<(), Box<dyn Error>> {
        let a = parse()?;
        let mut dev = PrunedAttention::new(0)?;
        println!("device: {}", dev.device_name());
        println!(
            "shape: {} layers, {} heads, {} KV heads, head_dim {}, f16 KV, batch 1, {} tokens timed",
            a.layers, a.heads, a.kv_heads, a.head_dim, a.iters
        );
        let mut table = Vec::new();
        for &n_ctx in &a.contexts {
            let page = a.prunes[0].page;
            let shape = LayerKvShape {
                n_seq: 1,
                n_head_kv: a.kv_heads,
                n_ctx,
                head_dim: a.head_dim,
                dtype: KvDtype::F16,
                page,
            };
            let n = n_ctx * a.kv_heads * a.head_dim;
            let (k, v) = (fill(1 + n_ctx as u64, n), fill(2 + n_ctx as u64, n));
            let mut layers = Vec::new();
            for _ in 0..a.layers {
                let mut kv = dev.upload_kv(shape, &k, &v)?;
                dev.refresh_bounds(&mut kv, 0, 0, n_ctx)?;
                layers.push(kv);
            }
            let q = dev.upload_f32(&fill(3, a.heads * a.head_dim))?;
            let slots = dev.upload_i32(&[0, (n_ctx - 1) as i32])?;
            let mut out = dev.upload_f32(&vec![0.0; a.heads * a.head_dim])?;
            let last_page = (n_ctx - 1) / page;
            // select_only: the page choice alone (box refresh + bounds +
            // selection), to show its share of the pruned time.
            let mut time = |dev: &mut PrunedAttention,
                            prune: Option<&KvPruning>,
                            select_only: bool|
             -> Result<f64, Box<dyn Error>> {
                let mut token = |dev: &mut PrunedAttention| -> Result<(), Box<dyn Error>> {
                    for kv in layers.iter_mut() {
                        match prune {
                            None => dev.attend_full(kv, &q, &slots, 1, a.heads, &mut out)?,
                            Some(cfg) => {
                                // A decode step refreshes the box of the page it wrote.
                                dev.refresh_bounds(kv, 0, last_page, n_ctx)?;
                                if select_only {
                                    dev.select_only(kv, &q, &slots, 1, a.heads, cfg)?;
                                } else {
                                    dev.attend_pruned(kv, &q, &slots, 1, a.heads, cfg, &mut out)?;
                                }
                            }
                        }
                    }
                    Ok(())
                };
                for _ in 0..5 {
                    token(dev)?;
                }
                dev.synchronize()?;
                let t = Instant::now();
                for _ in 0..a.iters {
                    token(dev)?;
                }
                dev.synchronize()?;
                Ok(t.elapsed().as_secs_f64() * 1e3 / a.iters as f64)
            };
            let full = time(&mut dev, None, false)?;
            let mut row = vec![format!("{n_ctx}"), format!("{full:.3}")];
            for cfg in &a.prunes {
                let ms = time(&mut dev, Some(cfg), false)?;
                let sel = time(&mut dev, Some(cfg), true)?;
                let pages = n_ctx.div_ceil(cfg.page);
                let kept = cfg.max_selected_for(pages).min(pages) * cfg.page;
                row.push(format!(
                    "{ms:.3} ({:.2}x, {kept} pos, choice {sel:.3})",
                    full / ms
                ));
            }
            println!("context {n_ctx}: {}", row[1..].join(" | "));
            table.push(row);
        }
        println!();
        let heads: Vec<String> = a
            .prunes
            .iter()
            .map(|c| {
                format!(
                    "pruned page={},sinks={},recent={},top={},top%={}",
                    c.page, c.sink_pages, c.recent_pages, c.top_pages, c.top_percent
                )
            })
            .collect();
        println!("| context | full ms/token | {} |", heads.join(" | "));
        println!("|---|---|{}", "---|".repeat(heads.len()));
        for r in table {
            println!("| {} |", r.join(" | "));
        }
        Ok(())
    }
}
