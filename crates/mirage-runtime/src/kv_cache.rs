//! The CPU key/value cache.
//!
//! Layout: per layer, per sequence slot, per KV head, one contiguous
//! `[n_ctx, head_dim]` block for keys and one for values, so that the
//! attention of one head walks memory linearly. Storage is f32, f16 or
//! q8_0 (ggml's blocks of 32: one f16 scale and 32 signed bytes, along
//! `head_dim`, so a row is whole blocks).

use crate::error::RuntimeError;
use half::f16;

/// Element type of the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvDtype {
    /// 32-bit floats (the default: exact with respect to the activations).
    #[default]
    F32,
    /// IEEE halves (half the memory, as llama.cpp's default cache).
    F16,
    /// ggml Q8_0 blocks (34 bytes per 32 values, about 0.27x of f32), as
    /// llama.cpp's `--cache-type-k/v q8_0`. Needs `head_dim % 32 == 0`.
    /// Attention widens the rows it reads to f32 (per call), so it saves
    /// memory, not time.
    Q8_0,
}

/// Values per Q8_0 block.
pub const Q8_0_BLOCK: usize = 32;

/// Quantizes `src` (a multiple of 32 values) into Q8_0 blocks as ggml's
/// `quantize_row_q8_0_ref`: `d = max|x| / 127`, `q = round(x / d)`.
pub fn quantize_q8_0(src: &[f32], q: &mut [i8], d: &mut [f16]) {
    for ((x, qb), db) in src
        .chunks_exact(Q8_0_BLOCK)
        .zip(q.chunks_exact_mut(Q8_0_BLOCK))
        .zip(d.iter_mut())
    {
        let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let scale = amax / 127.0;
        let inv = if scale != 0.0 { 1.0 / scale } else { 0.0 };
        for (o, v) in qb.iter_mut().zip(x) {
            *o = (v * inv).round() as i8;
        }
        *db = f16::from_f32(scale);
    }
}

/// Widens Q8_0 blocks back to f32 (`out.len()` values, a multiple of 32).
pub fn dequantize_q8_0(q: &[i8], d: &[f16], out: &mut [f32]) {
    for ((o, qb), db) in out
        .chunks_exact_mut(Q8_0_BLOCK)
        .zip(q.chunks_exact(Q8_0_BLOCK))
        .zip(d)
    {
        let s = db.to_f32();
        for (x, &v) in o.iter_mut().zip(qb) {
            *x = v as f32 * s;
        }
    }
}

/// Shape of a KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvSpec {
    /// Layers.
    pub n_layer: usize,
    /// KV heads per layer.
    pub n_head_kv: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// Positions per sequence.
    pub n_ctx: usize,
    /// Independent sequence slots (batch of decodes).
    pub n_seq: usize,
    /// Element type.
    pub dtype: KvDtype,
}

impl KvDtype {
    /// Bytes of `n` stored values (Q8_0: 34 bytes a block of 32).
    pub fn bytes_for(self, n: u64) -> Option<u64> {
        match self {
            KvDtype::F32 => n.checked_mul(4),
            KvDtype::F16 => n.checked_mul(2),
            KvDtype::Q8_0 => (n / Q8_0_BLOCK as u64).checked_mul(Q8_0_BLOCK as u64 + 2),
        }
    }

    /// The name users type (`f32`, `f16`, `q8_0`).
    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
            KvDtype::Q8_0 => "q8_0",
        }
    }
}

impl KvSpec {
    /// Values stored for keys and values together, when it fits a u64.
    pub fn values(&self) -> Option<u64> {
        [
            self.n_seq,
            self.n_head_kv,
            self.n_ctx,
            self.head_dim,
            self.n_layer,
        ]
        .iter()
        .try_fold(2u64, |acc, &x| acc.checked_mul(x as u64))
    }

    /// Bytes of keys and values together, when it fits a u64.
    pub fn bytes(&self) -> Option<u64> {
        self.dtype.bytes_for(self.values()?)
    }

    /// `KV cache of 30 layers x 1 sequence x 4096 positions (f32)`, for messages.
    pub fn describe(&self) -> String {
        format!(
            "KV cache of {} layers x {} sequence{} x {} positions ({})",
            self.n_layer,
            self.n_seq,
            if self.n_seq == 1 { "" } else { "s" },
            self.n_ctx,
            self.dtype.name()
        )
    }

    /// Refuses a cache larger than the memory available
    /// ([`crate::memory::available_bytes`]) or whose size overflows.
    pub fn check_fits_memory(&self) -> Result<(), RuntimeError> {
        let needed = self.bytes().ok_or_else(|| RuntimeError::OutOfMemory {
            what: self.describe(),
            needed: u64::MAX,
            available: crate::memory::available_bytes().unwrap_or(0),
        })?;
        crate::memory::check_fits(|| self.describe(), needed)
    }
}

#[derive(Debug)]
enum Store {
    F32(Vec<f32>),
    F16(Vec<f16>),
    /// Quantized values and one scale per 32 of them.
    Q8_0(Vec<i8>, Vec<f16>),
}

impl Store {
    /// `n` zeroed values; an allocation the system refuses is an error.
    fn new(dtype: KvDtype, n: usize, what: &str) -> Result<Store, RuntimeError> {
        use crate::memory::try_zeroed_vec;
        Ok(match dtype {
            KvDtype::F32 => Store::F32(try_zeroed_vec(n, what)?),
            KvDtype::F16 => Store::F16(try_zeroed_vec(n, what)?),
            KvDtype::Q8_0 => Store::Q8_0(
                try_zeroed_vec(n, what)?,
                try_zeroed_vec(n / Q8_0_BLOCK, what)?,
            ),
        })
    }
    fn write(&mut self, at: usize, src: &[f32]) {
        match self {
            Store::F32(v) => v[at..at + src.len()].copy_from_slice(src),
            Store::F16(v) => {
                for (d, &s) in v[at..at + src.len()].iter_mut().zip(src) {
                    *d = f16::from_f32(s);
                }
            }
            Store::Q8_0(q, d) => {
                let b = at / Q8_0_BLOCK;
                quantize_q8_0(
                    src,
                    &mut q[at..at + src.len()],
                    &mut d[b..b + src.len() / Q8_0_BLOCK],
                );
            }
        }
    }
}

/// Key/value cache for every layer and sequence slot.
#[derive(Debug)]
pub struct KvCache {
    spec: KvSpec,
    k: Vec<Store>,
    v: Vec<Store>,
    lens: Vec<usize>,
    /// Page summaries for pruned attention (see [`crate::kv_pages`]).
    paged: Option<crate::kv_pages::PagedKv>,
}

impl KvCache {
    /// Allocates a zeroed cache; refuses one larger than the memory
    /// available, naming both sizes.
    pub fn new(spec: KvSpec) -> Result<KvCache, RuntimeError> {
        let per_layer = spec
            .n_seq
            .checked_mul(spec.n_head_kv)
            .and_then(|x| x.checked_mul(spec.n_ctx))
            .and_then(|x| x.checked_mul(spec.head_dim))
            .ok_or_else(|| RuntimeError::InvalidArgument("KV cache size overflows".into()))?;
        if spec.head_dim == 0 || spec.n_ctx == 0 || spec.n_seq == 0 {
            return Err(RuntimeError::InvalidArgument(format!(
                "empty KV cache shape {spec:?}"
            )));
        }
        if spec.dtype == KvDtype::Q8_0 && !spec.head_dim.is_multiple_of(Q8_0_BLOCK) {
            return Err(RuntimeError::InvalidArgument(format!(
                "a q8_0 KV cache needs head_dim divisible by {Q8_0_BLOCK}, not {}",
                spec.head_dim
            )));
        }
        spec.check_fits_memory()?;
        let what = spec.describe();
        let stores = || -> Result<Vec<Store>, RuntimeError> {
            (0..spec.n_layer)
                .map(|_| Store::new(spec.dtype, per_layer, &what))
                .collect()
        };
        let (k, v) = (stores()?, stores()?);
        Ok(KvCache {
            spec,
            k,
            v,
            lens: crate::memory::try_zeroed_vec(spec.n_seq, &what)?,
            paged: None,
        })
    }

    /// The shape it was built with.
    pub fn spec(&self) -> &KvSpec {
        &self.spec
    }

    /// Positions filled in sequence `seq` (0 for an unknown slot).
    pub fn len(&self, seq: usize) -> usize {
        self.lens.get(seq).copied().unwrap_or(0)
    }

    /// Whether every sequence is empty.
    pub fn is_empty(&self) -> bool {
        self.lens.iter().all(|&l| l == 0)
    }

    /// Forgets sequence `seq` from position `pos` on (0 clears it).
    pub fn truncate(&mut self, seq: usize, pos: usize) {
        if let Some(l) = self.lens.get_mut(seq) {
            *l = (*l).min(pos);
        }
        if let Some(mut paged) = self.paged.take() {
            let hd = self.spec.head_dim;
            paged.summaries.truncate(seq, pos, |layer, head, p, out| {
                self.head_view(layer, seq, head).key(p, &mut out[..hd])
            });
            self.paged = Some(paged);
        }
    }

    /// Forgets every sequence.
    pub fn clear(&mut self) {
        for seq in 0..self.spec.n_seq {
            self.truncate(seq, 0);
        }
    }

    pub(crate) fn paged(&self) -> Option<&crate::kv_pages::PagedKv> {
        self.paged.as_ref()
    }

    pub(crate) fn paged_mut(&mut self) -> &mut Option<crate::kv_pages::PagedKv> {
        &mut self.paged
    }

    /// Keys and values of KV head `head` of `seq` in `layer` (all `n_ctx`
    /// rows). Callers check the ranges.
    pub fn head_view(
        &self,
        layer: usize,
        seq: usize,
        head: usize,
    ) -> crate::attention_pruned::KvHeadView<'_> {
        let (at, len) = (
            self.base(seq, head, 0),
            self.spec.n_ctx * self.spec.head_dim,
        );
        match (&self.k[layer], &self.v[layer]) {
            (Store::F32(k), Store::F32(v)) => crate::attention_pruned::KvHeadView::F32 {
                k: &k[at..at + len],
                v: &v[at..at + len],
            },
            (Store::F16(k), Store::F16(v)) => crate::attention_pruned::KvHeadView::F16 {
                k: &k[at..at + len],
                v: &v[at..at + len],
            },
            (Store::Q8_0(kq, kd), Store::Q8_0(vq, vd)) => {
                let (b, blen) = (at / Q8_0_BLOCK, len / Q8_0_BLOCK);
                crate::attention_pruned::KvHeadView::Q8_0 {
                    k: (&kq[at..at + len], &kd[b..b + blen]),
                    v: (&vq[at..at + len], &vd[b..b + blen]),
                }
            }
            _ => unreachable!("k and v share one dtype"),
        }
    }

    fn base(&self, seq: usize, head: usize, pos: usize) -> usize {
        ((seq * self.spec.n_head_kv + head) * self.spec.n_ctx + pos) * self.spec.head_dim
    }

    /// Stores the keys and values of one token (`n_head_kv * head_dim` each,
    /// heads concatenated) at `pos` of `seq` in `layer`. The sequence length
    /// becomes at least `pos + 1` once the last layer is written.
    pub fn write(
        &mut self,
        layer: usize,
        seq: usize,
        pos: usize,
        k: &[f32],
        v: &[f32],
    ) -> Result<(), RuntimeError> {
        let s = self.spec;
        if layer >= s.n_layer || seq >= s.n_seq {
            return Err(RuntimeError::InvalidArgument(format!(
                "KV slot layer {layer} seq {seq} out of range"
            )));
        }
        if pos >= s.n_ctx {
            return Err(RuntimeError::ContextFull { n_ctx: s.n_ctx });
        }
        let hd = s.head_dim;
        if k.len() != s.n_head_kv * hd || v.len() != s.n_head_kv * hd {
            return Err(RuntimeError::InvalidArgument(
                "KV row has the wrong width".into(),
            ));
        }
        for h in 0..s.n_head_kv {
            let at = self.base(seq, h, pos);
            self.k[layer].write(at, &k[h * hd..(h + 1) * hd]);
            self.v[layer].write(at, &v[h * hd..(h + 1) * hd]);
        }
        if let Some(paged) = &mut self.paged {
            // The box of what is stored (f16 rounding included), so the bound holds for the cached keys.
            match &self.k[layer] {
                Store::F32(_) => paged.summaries.record(layer, seq, pos, k),
                Store::F16(_) => {
                    let rounded: Vec<f32> = k.iter().map(|&x| f16::from_f32(x).to_f32()).collect();
                    paged.summaries.record(layer, seq, pos, &rounded)
                }
                Store::Q8_0(q, d) => {
                    let mut stored = vec![0.0f32; k.len()];
                    for h in 0..s.n_head_kv {
                        // self.base, spelled out: `paged` borrows self mutably.
                        let at = ((seq * s.n_head_kv + h) * s.n_ctx + pos) * hd;
                        let b = at / Q8_0_BLOCK;
                        dequantize_q8_0(
                            &q[at..at + hd],
                            &d[b..b + hd / Q8_0_BLOCK],
                            &mut stored[h * hd..(h + 1) * hd],
                        );
                    }
                    paged.summaries.record(layer, seq, pos, &stored)
                }
            }
        }
        if layer + 1 == s.n_layer {
            self.lens[seq] = self.lens[seq].max(pos + 1);
        }
        Ok(())
    }

    /// Attention of query head `q` over positions `0..n` of KV head `head`
    /// of `seq` in `layer`: `out = softmax(q.K^T * scale) V`. `scores` needs
    /// `n` elements. Callers check the ranges.
    #[allow(clippy::too_many_arguments)]
    pub fn attend(
        &self,
        layer: usize,
        seq: usize,
        head: usize,
        n: usize,
        q: &[f32],
        scale: f32,
        scores: &mut [f32],
        out: &mut [f32],
    ) {
        self.attend_span(layer, seq, head, 0..n, q, scale, scores, out)
    }

    /// [`KvCache::attend`] over positions `span` only (a sliding window):
    /// the softmax runs over exactly those positions. `scores` needs
    /// `span.len()` elements. Callers check the ranges.
    #[allow(clippy::too_many_arguments)]
    pub fn attend_span(
        &self,
        layer: usize,
        seq: usize,
        head: usize,
        span: std::ops::Range<usize>,
        q: &[f32],
        scale: f32,
        scores: &mut [f32],
        out: &mut [f32],
    ) {
        let hd = self.spec.head_dim;
        let n = span.len();
        let at = self.base(seq, head, span.start);
        match (&self.k[layer], &self.v[layer]) {
            (Store::F32(k), Store::F32(v)) => crate::ops::attend_f32(
                q,
                &k[at..at + n * hd],
                &v[at..at + n * hd],
                n,
                scale,
                scores,
                out,
            ),
            (Store::F16(k), Store::F16(v)) => {
                // The kernels widen on load (F16C): no widened copy of the
                // rows, which cost as much as the attention itself.
                crate::ops::attend_f16(
                    q,
                    &k[at..at + n * hd],
                    &v[at..at + n * hd],
                    n,
                    scale,
                    scores,
                    out,
                )
            }
            (Store::Q8_0(kq, kd), Store::Q8_0(vq, vd)) => {
                // Widened per call into a per-thread buffer, then the f32
                // kernel (the same one the f32 cache uses).
                let (b, nb) = (at / Q8_0_BLOCK, n * hd / Q8_0_BLOCK);
                WIDE.with(|w| {
                    let mut w = w.borrow_mut();
                    w.resize(2 * n * hd, 0.0);
                    let (kw, vw) = w.split_at_mut(n * hd);
                    dequantize_q8_0(&kq[at..at + n * hd], &kd[b..b + nb], kw);
                    dequantize_q8_0(&vq[at..at + n * hd], &vd[b..b + nb], vw);
                    crate::ops::attend_f32(q, kw, vw, n, scale, scores, out)
                })
            }
            _ => unreachable!("k and v share one dtype"),
        }
    }
}

thread_local! {
    /// Widened q8_0 rows of the head being attended.
    static WIDE: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_and_f32_caches_agree() {
        let mk = |dtype| {
            KvCache::new(KvSpec {
                n_layer: 2,
                n_head_kv: 2,
                head_dim: 4,
                n_ctx: 8,
                n_seq: 2,
                dtype,
            })
            .unwrap()
        };
        let (mut a, mut b) = (mk(KvDtype::F32), mk(KvDtype::F16));
        for pos in 0..5 {
            let k: Vec<f32> = (0..8).map(|i| ((i + pos) as f32 * 0.3).sin()).collect();
            let v: Vec<f32> = (0..8).map(|i| ((i * pos) as f32 * 0.2).cos()).collect();
            for l in 0..2 {
                a.write(l, 1, pos, &k, &v).unwrap();
                b.write(l, 1, pos, &k, &v).unwrap();
            }
        }
        assert_eq!(a.len(1), 5);
        assert_eq!(a.len(0), 0);
        let q = [0.5f32, -0.3, 0.8, 0.1];
        let (mut s, mut oa, mut ob) = ([0.0f32; 5], [0.0f32; 4], [0.0f32; 4]);
        a.attend(1, 1, 1, 5, &q, 0.5, &mut s, &mut oa);
        b.attend(1, 1, 1, 5, &q, 0.5, &mut s, &mut ob);
        for i in 0..4 {
            assert!((oa[i] - ob[i]).abs() < 2e-3);
        }
        assert!(matches!(
            a.write(0, 0, 8, &[0.0; 8], &[0.0; 8]),
            Err(RuntimeError::ContextFull { .. })
        ));
        a.truncate(1, 2);
        assert_eq!(a.len(1), 2);
    }
}
