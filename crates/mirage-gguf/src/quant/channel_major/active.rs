//! The active input channels of one input vector, quantized to int8 per
//! group: what every tile kernel reads.

use std::ops::Range;

#[cfg(target_arch = "x86_64")]
use super::avx512;

/// `q` (|q| <= 127) rounded to the nearest integer, ties to even: the
/// float add of 1.5 * 2^23 leaves the rounded value in the low mantissa
/// bits (no call into libm's `roundf`, which the baseline x86-64 target
/// does not inline).
#[inline]
fn round_i8(q: f32) -> i8 {
    let r = (q + 12_582_912.0f32).to_bits() as i32 - 0x4B40_0000;
    r.clamp(-127, 127) as i8
}

/// A group's largest active channel, taken out of the group's int8 scale
/// and multiplied on its own (see [`ActiveChannels`]): one set whose four
/// positions are that channel, code `±127` first and 0 after, with the
/// scale `|x| / 127`, so that the channel enters the product exactly.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Lone {
    pub(super) idx: [u8; 4],
    pub(super) xq: i32,
    pub(super) dx: f32,
    pub(super) sum: i32,
}

impl Lone {
    fn new(pos: u8, v: f32) -> Lone {
        let code: i8 = if v < 0.0 { -127 } else { 127 };
        Lone {
            idx: [pos; 4],
            xq: code as u8 as i32,
            dx: v.abs() / 127.0,
            sum: code as i32,
        }
    }
}

/// Per group: the largest and second-largest `|x|` of its active channels
/// and the position of the largest (`NONE` when no active channel is
/// above 0).
#[derive(Debug, Clone, Copy)]
pub(super) struct GroupTop {
    pub(super) a1: f32,
    pub(super) a2: f32,
    pub(super) pos: u8,
}

impl GroupTop {
    pub(super) const NONE: u8 = u8::MAX;
}

/// Which groups' largest channel goes on its own: where taking it out of
/// the group's scale removes more rounding error than the vector's average
/// group holds. A group's int8 step is `a1 / 127`, so its error energy goes
/// with `a1^2`; without its largest channel the step is `a2 / 127`. A
/// channel far above the rest of its group (the outlier features of these
/// models) otherwise rounds its whole group coarsely: on SmolLM2 the
/// repacked model's logit cosine against f32 activations went from 0.99964
/// to 0.99992 with about one group in seven split.
fn lone_of(tops: &[GroupTop]) -> impl Fn(&GroupTop) -> bool {
    // The same summation order on every path (the lists compare bit for bit).
    let mut e = 0f32;
    for t in tops {
        e += t.a1 * t.a1;
    }
    let mean = e / tops.len().max(1) as f32;
    move |t: &GroupTop| t.pos != GroupTop::NONE && t.a2 > 0.0 && t.a1 * t.a1 - t.a2 * t.a2 > mean
}

/// The active input channels of one input vector, grouped by scale group
/// and quantized to int8 with one scale per group: per group, sets of 4
/// channels (their positions in the group and their 4 codes packed in one
/// `i32`, a short last set padded with code 0), the scale `dx` and the sum
/// of the codes. A group whose largest channel is far above the rest (see
/// `lone_of`) has that channel as a [`Lone`] outside its sets and scale.
/// Built once per input vector and matrix, read by every tile; the
/// allocations are reused.
#[derive(Debug, Clone, Default)]
pub struct ActiveChannels {
    pub(super) group: usize,
    len: usize,
    set_start: Vec<u32>,
    pub(super) set_idx: Vec<[u8; 4]>,
    pub(super) set_xq: Vec<i32>,
    count: Vec<u16>,
    pub(super) dx: Vec<f32>,
    pub(super) sum: Vec<i32>,
    pub(super) lone: Vec<Option<Lone>>,
    keep: Vec<bool>,
    tops: Vec<GroupTop>,
}

impl ActiveChannels {
    /// Empties the list (keeping its allocations) for groups of `group`.
    fn reset(&mut self, group: usize) {
        self.group = group;
        self.len = 0;
        self.set_start.clear();
        self.set_idx.clear();
        self.set_xq.clear();
        self.count.clear();
        self.dx.clear();
        self.sum.clear();
        self.lone.clear();
    }

    /// Rebuilds the list from `x` (one input vector) keeping channel `i`
    /// when `keep(i, x_i)`; `group` is the layout's [`super::ChannelMajorLayout::group`]
    /// (at most 32).
    pub fn fill(&mut self, x: &[f32], group: usize, mut keep: impl FnMut(usize, f32) -> bool) {
        let group = group.clamp(1, 32);
        self.reset(group);
        let mut on = std::mem::take(&mut self.keep);
        on.clear();
        on.extend(x.iter().enumerate().map(|(i, &v)| keep(i, v)));
        let mut tops = std::mem::take(&mut self.tops);
        tops.clear();
        for (xs, os) in x.chunks(group).zip(on.chunks(group)) {
            let mut t = GroupTop {
                a1: 0.0,
                a2: 0.0,
                pos: GroupTop::NONE,
            };
            for (j, (&v, &o)) in xs.iter().zip(os).enumerate() {
                let a = if o { v.abs() } else { 0.0 };
                if a > t.a1 {
                    (t.a2, t.a1, t.pos) = (t.a1, a, j as u8);
                } else if a > t.a2 {
                    t.a2 = a;
                }
            }
            tops.push(t);
        }
        let is_lone = lone_of(&tops);
        let mut idx = [0u8; 32];
        let mut val = [0f32; 32];
        for (g, (xs, os)) in x.chunks(group).zip(on.chunks(group)).enumerate() {
            self.set_start.push(self.set_idx.len() as u32);
            let lone = is_lone(&tops[g]).then(|| tops[g].pos as usize);
            // Branch-free compaction: which channels pass is data, and at
            // the sparsities used about every other test would mispredict.
            let (mut k, mut amax) = (0usize, 0f32);
            for (j, (&v, &o)) in xs.iter().zip(os).enumerate() {
                let on = o && lone != Some(j);
                idx[k] = j as u8;
                val[k] = v;
                amax = amax.max(if on { v.abs() } else { 0.0 });
                k += on as usize;
            }
            let dx = amax / 127.0;
            let id = if amax > 0.0 { 127.0 / amax } else { 0.0 };
            let mut sum = 0i32;
            for s in (0..k).step_by(4) {
                let (mut ids, mut codes) = ([idx[k - 1]; 4], [0i8; 4]);
                for c in 0..4.min(k - s) {
                    ids[c] = idx[s + c];
                    codes[c] = round_i8(val[s + c] * id);
                    sum += codes[c] as i32;
                }
                self.set_idx.push(ids);
                self.set_xq.push(i32::from_le_bytes(codes.map(|c| c as u8)));
            }
            let lone = lone.map(|j| Lone::new(j as u8, xs[j]));
            let n = k + lone.is_some() as usize;
            self.len += n;
            self.count.push(n as u16);
            self.dx.push(dx);
            self.sum.push(sum);
            self.lone.push(lone);
        }
        self.set_start.push(self.set_idx.len() as u32);
        self.keep = on;
        self.tops = tops;
    }

    /// [`Self::fill`] keeping channel `i` when `|x_i| >= thr[i]` (`thr`
    /// `None`: every channel), with the same result bit for bit. With
    /// AVX-512 each group's test, scale and codes take a few vector
    /// instructions (the scalar loop cost about as much as a sparse
    /// product's synchronisation: a decode token builds ~200 lists).
    ///
    /// # Panics
    /// When `thr` is shorter than `x`.
    pub fn fill_above(&mut self, x: &[f32], group: usize, thr: Option<&[f32]>) {
        if let Some(t) = thr {
            assert!(
                t.len() >= x.len(),
                "{} thresholds for {} channels",
                t.len(),
                x.len()
            );
        }
        #[cfg(target_arch = "x86_64")]
        {
            if matches!(group, 16 | 32) && x.len().is_multiple_of(group) && avx512::available() {
                self.reset(group);
                let thr_of = |g: usize| thr.map(|t| &t[g * group..(g + 1) * group]);
                let mut tops = std::mem::take(&mut self.tops);
                tops.clear();
                for (g, xs) in x.chunks_exact(group).enumerate() {
                    // SAFETY: AVX-512 checked above; `xs` and the
                    // thresholds hold `group` (16 or 32) values.
                    tops.push(unsafe { avx512::group_top(xs, thr_of(g)) });
                }
                let is_lone = lone_of(&tops);
                for (g, xs) in x.chunks_exact(group).enumerate() {
                    let lone = is_lone(&tops[g]).then(|| tops[g].pos);
                    // SAFETY: as above.
                    let f = unsafe { avx512::fill_group(xs, thr_of(g), lone) };
                    let lone = lone.map(|j| Lone::new(j, xs[j as usize]));
                    self.set_start.push(self.set_idx.len() as u32);
                    let k = f.k;
                    for s in (0..k).step_by(4) {
                        let mut ids = [0u8; 4];
                        ids.copy_from_slice(&f.idx[s..s + 4]);
                        self.set_idx.push(ids);
                        self.set_xq.push(i32::from_le_bytes([
                            f.codes[s],
                            f.codes[s + 1],
                            f.codes[s + 2],
                            f.codes[s + 3],
                        ]));
                    }
                    let n = k + lone.is_some() as usize;
                    self.len += n;
                    self.count.push(n as u16);
                    self.dx.push(f.dx);
                    self.sum.push(f.sum);
                    self.lone.push(lone);
                }
                self.set_start.push(self.set_idx.len() as u32);
                self.tops = tops;
                return;
            }
        }
        match thr {
            Some(t) => self.fill(x, group, |i, v| v.abs() >= t[i]),
            None => self.fill(x, group, |_, _| true),
        }
    }

    /// Every channel of `x` active.
    pub fn all(x: &[f32], group: usize) -> ActiveChannels {
        let mut a = ActiveChannels::default();
        a.fill(x, group, |_, _| true);
        a
    }

    /// Active channels.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether no channel is active.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Groups the list was built over.
    pub fn n_groups(&self) -> usize {
        self.count.len()
    }
    /// Channels per group.
    pub fn group_size(&self) -> usize {
        self.group
    }
    /// Active channels of group `g`.
    pub fn group_len(&self, g: usize) -> usize {
        self.count[g] as usize
    }
    /// The active channel ids, ascending.
    pub fn channels(&self) -> Vec<u32> {
        let mut v = Vec::with_capacity(self.len);
        for g in 0..self.n_groups() {
            let first = v.len();
            let r = self.sets(g);
            let n = self.in_sets(g);
            for (k, ids) in self.set_idx[r].iter().enumerate() {
                for (c, &i) in ids.iter().enumerate() {
                    if 4 * k + c < n {
                        v.push((g * self.group) as u32 + i as u32);
                    }
                }
            }
            if let Some(l) = self.lone[g] {
                v.push((g * self.group) as u32 + l.idx[0] as u32);
                v[first..].sort_unstable();
            }
        }
        v
    }
    /// Channels of group `g` in its sets (without its lone channel).
    fn in_sets(&self, g: usize) -> usize {
        self.count[g] as usize - self.lone[g].is_some() as usize
    }
    /// The (dequantized) value the kernels use for each channel of `x`:
    /// `dx * xq` where active, 0 elsewhere (for references and tests).
    pub fn values(&self, cols: usize) -> Vec<f32> {
        let mut v = vec![0f32; cols];
        for g in 0..self.n_groups() {
            let n = self.in_sets(g);
            if let Some(l) = self.lone[g] {
                v[g * self.group + l.idx[0] as usize] = l.dx * l.xq as u8 as i8 as f32;
            }
            for (k, (ids, xq)) in self.set_idx[self.sets(g)]
                .iter()
                .zip(&self.set_xq[self.sets(g)])
                .enumerate()
            {
                let codes = xq.to_le_bytes();
                for c in 0..4 {
                    if 4 * k + c < n {
                        v[g * self.group + ids[c] as usize] = self.dx[g] * codes[c] as i8 as f32;
                    }
                }
            }
        }
        v
    }
    pub(super) fn sets(&self, g: usize) -> Range<usize> {
        self.set_start[g] as usize..self.set_start[g + 1] as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::channel_major::test_inputs::{lcg, values};

    /// The vector list builder gives the scalar one's lists exactly, at
    /// every density, for both group sizes, with and without thresholds.
    #[test]
    fn fill_above_matches_fill() {
        for group in [16usize, 32] {
            for (seed, cut) in [(1u64, 0.0f32), (2, 0.3), (3, 0.6), (4, 0.95), (5, 2.0)] {
                let cols = 512;
                let mut x = values(seed, cols);
                // Some exact zeros, a group entirely below, one entirely above.
                x[7] = 0.0;
                for v in &mut x[group..2 * group] {
                    *v *= 1e-3;
                }
                // Channels far above their groups (split off as lone
                // channels), one of them tied with another in its group.
                x[70] = 9.0;
                x[200] = -12.0;
                x[300] = 7.5;
                x[301] = -7.5;
                x[450] = f32::NAN;
                let thr: Vec<f32> = values(seed + 100, cols)
                    .iter()
                    .map(|v| cut * (0.5 + 0.5 * v.abs()))
                    .collect();
                for t in [Some(&thr[..]), None] {
                    let mut want = ActiveChannels::default();
                    match t {
                        Some(t) => want.fill(&x, group, |i, v| v.abs() >= t[i]),
                        None => want.fill(&x, group, |_, _| true),
                    }
                    let mut got = ActiveChannels::default();
                    got.fill_above(&x, group, t);
                    let ctx = format!("group {group} cut {cut} thr {}", t.is_some());
                    assert_eq!(got.len, want.len, "{ctx}");
                    assert_eq!(got.set_start, want.set_start, "{ctx}");
                    assert_eq!(got.set_idx, want.set_idx, "{ctx}");
                    assert_eq!(got.set_xq, want.set_xq, "{ctx}");
                    assert_eq!(got.count, want.count, "{ctx}");
                    assert_eq!(got.sum, want.sum, "{ctx}");
                    assert_eq!(got.lone, want.lone, "{ctx}");
                    if t.is_none() {
                        assert!(
                            want.lone.iter().any(|l| l.is_some()),
                            "{ctx}: no lone channel"
                        );
                    }
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&got.dx), bits(&want.dx), "{ctx}");
                }
            }
        }
    }

    /// A channel far above the rest of its group goes on its own: it
    /// keeps its value, and its group rounds at the step of the rest.
    #[test]
    fn an_outlier_channel_goes_on_its_own() {
        let mut x = lcg(11, 256);
        x[77] = -50.0;
        let act = ActiveChannels::all(&x, 32);
        let lone: Vec<usize> = (0..8).filter(|&g| act.lone[g].is_some()).collect();
        assert_eq!(lone, vec![2], "only the outlier's group splits");
        let v = act.values(256);
        assert!((v[77] + 50.0).abs() <= 50.0 * 1e-6, "{}", v[77]);
        let rest = x[64..96]
            .iter()
            .enumerate()
            .filter(|&(j, _)| j != 13)
            .fold(0f32, |m, (_, a)| m.max(a.abs()));
        for i in (64..96).filter(|&i| i != 77) {
            assert!((v[i] - x[i]).abs() <= rest / 254.0 * 1.0001, "{i}");
        }
        assert_eq!(act.len(), 256);
        assert_eq!(act.group_len(2), 32);
        assert_eq!(act.channels(), (0..256).collect::<Vec<u32>>());
        // With thresholds dropping half of the group, the lone channel stays
        // in the ascending list.
        let mut some = ActiveChannels::default();
        some.fill(&x, 32, |i, _| i % 2 == 1);
        let ch = some.channels();
        assert!(ch.windows(2).all(|w| w[0] < w[1]) && ch.contains(&77));
        assert_eq!(ch.len(), some.len());
    }

    /// The int8 activations stay within the quantization step of the
    /// inputs: the kernels' product is the exact one to about 1 %.
    #[test]
    fn int8_activations_are_close_to_the_inputs() {
        let x = lcg(5, 1024);
        let act = ActiveChannels::all(&x, 32);
        let v = act.values(1024);
        for g in 0..32 {
            let amax = x[32 * g..32 * g + 32]
                .iter()
                .fold(0f32, |m, a| m.max(a.abs()));
            for i in 32 * g..32 * g + 32 {
                assert!((v[i] - x[i]).abs() <= amax / 254.0 * 1.0001, "{i}");
            }
        }
        assert_eq!(act.len(), 1024);
        assert_eq!(act.channels(), (0..1024).collect::<Vec<u32>>());
    }
}
