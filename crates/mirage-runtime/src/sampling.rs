//! Token sampling: greedy, temperature, top-k, top-p, min-p, repetition and
//! presence/frequency penalties, seeded randomness; plus stop-string
//! matching for streamed text.
//!
//! The order of the transforms follows llama.cpp's default sampler chain:
//! penalties, then top-k, top-p, min-p, then temperature and the draw. A
//! temperature of zero means greedy after the penalties.
//! [`SamplingParams::validate`] is the one range check every frontend
//! shares.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;

/// Sampling knobs. [`SamplingParams::default`] is greedy with no penalties.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature; 0 selects the arg-max (greedy). Negative,
    /// infinite and NaN values are refused ([`SamplingParams::validate`]).
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; 0 disables.
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches `top_p`; 1 disables.
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely one; 0 disables.
    pub min_p: f32,
    /// CTRL-style repetition penalty on recently seen tokens; 1 disables.
    pub repeat_penalty: f32,
    /// Subtracted from the logit of every recently seen token; 0 disables.
    pub presence_penalty: f32,
    /// Subtracted once per occurrence of a recently seen token; 0 disables.
    pub frequency_penalty: f32,
    /// How many of the latest tokens the penalties look at.
    pub penalty_last_n: usize,
    /// Seed of the random draw; the same seed and inputs give the same tokens.
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repeat_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            penalty_last_n: 64,
            seed: 0,
        }
    }
}

impl SamplingParams {
    /// Refuses values that are out of range or not numbers, naming the
    /// field: `temperature` finite and >= 0 (0: greedy), `top_p` in (0, 1],
    /// `min_p` in [0, 1], `repeat_penalty` finite and > 0, the presence and
    /// frequency penalties within ±1e6 (OpenAI allows ±2; larger values only
    /// ever mean "never repeat", and a huge one turns logits into
    /// infinities). Generation calls it first; frontends may check narrower
    /// ranges of their own on top.
    pub fn validate(&self) -> Result<(), crate::RuntimeError> {
        let bad = |field: &str, value: f32, want: &str| {
            Err(crate::RuntimeError::InvalidArgument(format!(
                "sampling parameter {field} is {value}, expected {want}"
            )))
        };
        let t = self.temperature;
        if !(t.is_finite() && t >= 0.0) {
            return bad("temperature", t, "a finite number >= 0 (0: greedy)");
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", self.top_p, "a number in (0, 1] (1: off)");
        }
        if !(self.min_p >= 0.0 && self.min_p <= 1.0) {
            return bad("min_p", self.min_p, "a number in [0, 1] (0: off)");
        }
        let r = self.repeat_penalty;
        if !(r.is_finite() && r > 0.0) {
            return bad("repeat_penalty", r, "a finite number > 0 (1: off)");
        }
        for (field, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if v.is_nan() || v.abs() > 1e6 {
                return bad(field, v, "a number within ±1e6 (0: off)");
            }
        }
        Ok(())
    }
}

/// A stateful sampler: owns its random generator and scratch buffers so that
/// a decode step does not allocate.
#[derive(Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
    candidates: Vec<(u32, f32)>,
    counts: HashMap<u32, u32>,
}

impl Sampler {
    /// A sampler seeded from `params.seed`.
    pub fn new(params: SamplingParams) -> Sampler {
        let rng = StdRng::seed_from_u64(params.seed);
        Sampler {
            params,
            rng,
            candidates: Vec::new(),
            counts: HashMap::new(),
        }
    }

    /// The parameters this sampler was built with.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Picks the next token from `logits` given the tokens seen so far
    /// (prompt and generated, oldest first). Returns 0 for empty logits.
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        self.sample_masked(logits, history, None)
            .expect("an absent mask allows every token")
    }

    /// [`Sampler::sample`] among the tokens `mask` allows (every token when
    /// `None`); `None` when the mask allows no token of `logits`.
    /// Disallowed tokens get a logit of minus infinity before the
    /// penalties, so the rest of the chain sees only allowed tokens.
    pub fn sample_masked(
        &mut self,
        logits: &[f32],
        history: &[u32],
        mask: Option<&crate::constraint::TokenMask>,
    ) -> Option<u32> {
        if logits.is_empty() {
            return mask.is_none().then_some(0);
        }
        let p = self.params.clone();
        self.candidates.clear();
        self.candidates
            .extend(logits.iter().enumerate().map(|(i, &l)| (i as u32, l)));
        if let Some(mask) = mask {
            let mut any = false;
            for c in &mut self.candidates {
                if mask.is_allowed(c.0) {
                    any = true;
                } else {
                    c.1 = f32::NEG_INFINITY;
                }
            }
            if !any {
                return None;
            }
        }
        self.apply_penalties(history);
        if p.temperature <= 0.0 {
            return Some(arg_max(&self.candidates));
        }
        let (keep, max) = self.cut();
        let cands = &self.candidates[..keep];
        let inv_t = 1.0 / p.temperature;
        let weights: Vec<f32> = cands
            .iter()
            .map(|c| fast_exp((c.1 - max) * inv_t))
            .collect();
        let sum: f32 = weights.iter().sum();
        let mut r = self.rng.random::<f32>() * sum;
        for (c, w) in cands.iter().zip(&weights) {
            if r < *w {
                return Some(c.0);
            }
            r -= w;
        }
        Some(cands[keep - 1].0)
    }

    /// Applies top-k, top-p and min-p to the candidates (after the
    /// penalties): the first `keep` of them, in the order the draw walks,
    /// are the ones left; `max` is the best logit.
    fn cut(&mut self) -> (usize, f32) {
        // Top-k, top-p and min-p keep prefixes of the candidates sorted best
        // first. The order is total (logit, then id), so the k best,
        // selected in linear time and then sorted, are the same prefix a
        // sort of the whole vocabulary gives, and without top-k only the
        // prefix that top-p and min-p can keep needs sorting (151,936
        // candidates for Qwen: a full sort cost more than a small model's
        // CPU decode step takes to pick its weights' next bytes).
        let order = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        let p = &self.params;
        let c = &mut self.candidates;
        let top_k = p.top_k > 0 && p.top_k < c.len();
        if top_k {
            c.select_nth_unstable_by(p.top_k - 1, order);
            c.truncate(p.top_k);
        }
        // Probabilities at temperature 1 relative to the best candidate, as
        // llama.cpp's top-p/min-p see them.
        let (best, max) = *c.iter().min_by(|a, b| order(a, b)).expect("not empty");
        let prob = |c: &(u32, f32)| fast_exp(c.1 - max);
        let (total, sorted) = if top_k || c.len() <= FULL_SORT {
            c.sort_unstable_by(order);
            (c.iter().map(prob).sum::<f32>(), c.len())
        } else if p.top_p >= 1.0 && p.min_p <= 0.0 {
            // Nothing to cut: the draw needs no order.
            (f32::NAN, 0)
        } else {
            let total: f32 = c.iter().map(prob).sum();
            if p.min_p > 0.0 {
                // Min-p keeps every candidate at least min_p times as likely
                // as the best one, and the best itself (whose probability is
                // NaN when its logit is infinite): a filter in vocabulary
                // order. On a flat distribution that is most of the
                // vocabulary, which a sort of the best 512 does not reach,
                // and sorting it all cost 4-8 ms a draw.
                let cut = p.min_p;
                c.retain(|x| x.0 == best || prob(x) >= cut);
                if p.top_p >= 1.0 {
                    return (c.len(), max);
                }
            }
            (total, sort_kept_prefix(c, order, &prob, total, p.top_p))
        };
        let mut keep = c.len();
        if sorted > 0 {
            keep = sorted;
            let probs: Vec<f32> = c[..keep].iter().map(prob).collect();
            if p.top_p < 1.0 {
                let mut cum = 0.0;
                for (i, pr) in probs.iter().enumerate() {
                    cum += pr / total;
                    if cum >= p.top_p {
                        keep = i + 1;
                        break;
                    }
                }
            }
            if p.min_p > 0.0 {
                // probs[0] is the maximum (exp(0) = 1).
                let cut = p.min_p;
                let n = probs[..keep].iter().take_while(|&&pr| pr >= cut).count();
                keep = n.max(1);
            }
        }
        (keep, max)
    }

    fn apply_penalties(&mut self, history: &[u32]) {
        let p = &self.params;
        if p.repeat_penalty == 1.0 && p.presence_penalty == 0.0 && p.frequency_penalty == 0.0 {
            return;
        }
        let start = history.len().saturating_sub(p.penalty_last_n);
        self.counts.clear();
        for &t in &history[start..] {
            *self.counts.entry(t).or_insert(0) += 1;
        }
        for (&tok, &count) in &self.counts {
            let Some(c) = self.candidates.get_mut(tok as usize) else {
                continue;
            };
            if p.repeat_penalty != 1.0 {
                c.1 = if c.1 <= 0.0 {
                    c.1 * p.repeat_penalty
                } else {
                    c.1 / p.repeat_penalty
                };
            }
            c.1 -= count as f32 * p.frequency_penalty + p.presence_penalty;
        }
    }
}

/// `e^x` for the sampler's weights and probabilities: within 3e-7 of it
/// (relative: two or three f32 ulps), exactly 1 at 0 and 0 below -87.5
/// (minus infinity included: masked tokens). A draw without top-k weighs the
/// whole vocabulary, and libm's `expf` of values far below 0 (a low
/// temperature spreads the logits) took twice as long as this: on 151,936
/// logits spread over 250 units, 1.4-1.6 ms a draw against 0.65-0.85 ms.
#[inline(always)]
fn fast_exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 in two parts (Cody-Waite): k * LN2_HI is exact for |k| < 2^9.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding and subtracting 1.5 * 2^23 rounds to the nearest integer.
    const ROUND: f32 = 12_582_912.0;
    let xc = x.clamp(-87.5, 88.0);
    let k = (xc * LOG2E + ROUND) - ROUND;
    let r = (xc - k * LN2_HI) - k * LN2_LO;
    // e^r on |r| <= ln(2) / 2: Taylor to degree 6 (error < r^7 / 7! ~ 1.2e-7).
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    let two_k = f32::from_bits(((k as i32 + 127) as u32) << 23);
    if x < -87.5 {
        0.0
    } else {
        p * two_k
    }
}

/// The candidates [`sort_kept_prefix`] first tries to cut within.
const FIRST_PREFIX: usize = 512;

/// Candidates up to this many are sorted whole.
const FULL_SORT: usize = 1024;

/// Sorts best first the shortest prefix of `c` that holds every candidate
/// top-p (`top_p` of `total`, the probabilities' sum) may keep (min-p has
/// already filtered `c`), and returns its length: the best [`FIRST_PREFIX`]
/// are selected and sorted; when top-p's running sum does not reach `top_p`
/// inside them, the whole of `c` is sorted (so a flat distribution costs one
/// selection more than a sort).
fn sort_kept_prefix(
    c: &mut [(u32, f32)],
    order: impl Fn(&(u32, f32), &(u32, f32)) -> std::cmp::Ordering + Copy,
    prob: &impl Fn(&(u32, f32)) -> f32,
    total: f32,
    top_p: f32,
) -> usize {
    let k = FIRST_PREFIX;
    if k < c.len() {
        c.select_nth_unstable_by(k - 1, order);
        c[..k].sort_unstable_by(order);
        // The same running sum as the caller's cut, so that where it stops
        // inside this prefix the caller's does too.
        let mut cum = 0.0f32;
        let top_p_inside = top_p < 1.0
            && c[..k].iter().any(|x| {
                cum += prob(x) / total;
                cum >= top_p
            });
        if top_p_inside {
            return k;
        }
    }
    c.sort_unstable_by(order);
    c.len()
}

fn arg_max(c: &[(u32, f32)]) -> u32 {
    let mut best = c[0];
    for &x in &c[1..] {
        if x.1 > best.1 {
            best = x;
        }
    }
    best.0
}

/// The log-probability of one token and, when asked, of the most likely
/// tokens at the same step.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    /// The sampled token.
    pub token: u32,
    /// Its natural-log probability.
    pub logprob: f32,
    /// The `top_logprobs` most likely tokens with their log-probabilities,
    /// most likely first (ties: lower id first).
    pub top: Vec<(u32, f32)>,
}

/// Most alternatives [`token_logprob`] reports per token (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// Log-softmax of the model's raw `logits` at `token`, and the `top_n`
/// (at most [`MAX_TOP_LOGPROBS`]) most likely tokens.
///
/// Raw means before penalties, temperature, top-k/p and any grammar mask:
/// the model's own distribution, as OpenAI reports it and as vLLM does by
/// default. A grammar may therefore sample a token that is not the most
/// likely one; with greedy sampling and nothing else in the way the
/// sampled token is the first of `top`.
pub fn token_logprob(logits: &[f32], token: u32, top_n: usize) -> TokenLogprob {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    // Sum in f64: 151,936 terms in f32 lose about three digits.
    let sum: f64 = logits.iter().map(|&l| ((l - max) as f64).exp()).sum();
    let log_z = max as f64 + sum.ln();
    let lp = |l: f32| (l as f64 - log_z) as f32;
    let logprob = logits
        .get(token as usize)
        .map_or(f32::NEG_INFINITY, |&l| lp(l));
    let n = top_n.min(MAX_TOP_LOGPROBS).min(logits.len());
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(n + 1);
    if n > 0 {
        // Keep the n best seen so far, sorted descending; most logits are
        // below the current n-th and cost one compare.
        for (i, &l) in logits.iter().enumerate() {
            if top.len() == n && l <= top[n - 1].1 {
                continue;
            }
            let at = top.partition_point(|&(_, v)| v >= l);
            top.insert(at, (i as u32, l));
            top.truncate(n);
        }
    }
    TokenLogprob {
        token,
        logprob,
        top: top.into_iter().map(|(t, l)| (t, lp(l))).collect(),
    }
}

/// Index of the largest logit (first on ties); 0 for an empty slice.
pub fn greedy(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// What [`StopStrings::check`] found in the text generated so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopCheck {
    /// A stop string starts at this byte: emit the text before it and stop.
    Stop(usize),
    /// No stop yet; text up to this byte is safe to emit (the rest could
    /// still grow into a stop string).
    Emit(usize),
}

/// Stop strings for streamed generation.
#[derive(Debug, Clone, Default)]
pub struct StopStrings {
    stops: Vec<String>,
}

impl StopStrings {
    /// Builds the matcher; empty strings are ignored.
    pub fn new<I: IntoIterator<Item = S>, S: Into<String>>(stops: I) -> StopStrings {
        StopStrings {
            stops: stops
                .into_iter()
                .map(Into::into)
                .filter(|s: &String| !s.is_empty())
                .collect(),
        }
    }

    /// Whether there are no stop strings.
    pub fn is_empty(&self) -> bool {
        self.stops.is_empty()
    }

    /// Looks for the earliest stop string in `text`; otherwise how much of
    /// `text` cannot be the start of one.
    pub fn check(&self, text: &str) -> StopCheck {
        let earliest = self
            .stops
            .iter()
            .filter_map(|s| text.find(s.as_str()))
            .min();
        if let Some(at) = earliest {
            return StopCheck::Stop(at);
        }
        // Hold back the longest suffix that is a proper prefix of a stop.
        let mut safe = text.len();
        for s in &self.stops {
            for k in (1..s.len()).rev() {
                if k <= text.len() && s.is_char_boundary(k) && text.ends_with(&s[..k]) {
                    safe = safe.min(text.len() - k);
                    break;
                }
            }
        }
        while !text.is_char_boundary(safe) {
            safe -= 1;
        }
        StopCheck::Emit(safe)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits() -> Vec<f32> {
        vec![1.0, 3.0, 2.5, -1.0, 0.0, 2.9]
    }

    #[test]
    fn greedy_picks_argmax() {
        let mut s = Sampler::new(SamplingParams::default());
        assert_eq!(s.sample(&logits(), &[]), 1);
        assert_eq!(greedy(&logits()), 1);
    }

    #[test]
    fn repetition_penalty_changes_greedy_choice() {
        let params = SamplingParams {
            repeat_penalty: 1.5,
            ..Default::default()
        };
        let mut s = Sampler::new(params);
        // 3.0/1.5 = 2.0 < 2.9: token 5 wins; then 2.9/1.5 < 2.5: token 2.
        assert_eq!(s.sample(&logits(), &[1]), 5);
        assert_eq!(s.sample(&logits(), &[1, 5]), 2);
        // Negative logits are multiplied, not divided.
        let mut s = Sampler::new(SamplingParams {
            repeat_penalty: 2.0,
            ..Default::default()
        });
        assert_eq!(s.sample(&[-1.0, -1.5], &[0]), 1);
    }

    #[test]
    fn presence_and_frequency_penalties() {
        let params = SamplingParams {
            frequency_penalty: 0.2,
            ..Default::default()
        };
        let mut s = Sampler::new(params);
        // 3.0 - 0.2 = 2.8 < 2.9.
        assert_eq!(s.sample(&logits(), &[1]), 5);
        let params = SamplingParams {
            presence_penalty: 0.05,
            ..Default::default()
        };
        let mut s = Sampler::new(params);
        assert_eq!(s.sample(&logits(), &[1, 1, 1]), 1);
        let params = SamplingParams {
            frequency_penalty: 0.05,
            ..Default::default()
        };
        let mut s = Sampler::new(params);
        assert_eq!(s.sample(&logits(), &[1, 1, 1]), 5);
    }

    #[test]
    fn top_k_one_is_greedy_even_when_hot() {
        let params = SamplingParams {
            temperature: 5.0,
            top_k: 1,
            seed: 9,
            ..Default::default()
        };
        let mut s = Sampler::new(params);
        for _ in 0..50 {
            assert_eq!(s.sample(&logits(), &[]), 1);
        }
    }

    #[test]
    fn the_cut_keeps_what_a_sort_of_the_whole_vocabulary_keeps() {
        // A peaked distribution over 50,000 tokens with repeated values, and
        // a flat one (min-p keeps most of it, as on a random model).
        let draw = |shape: fn(f32) -> f32| {
            let mut x = 7u64;
            (0..50_000)
                .map(|_| {
                    x = x
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    shape((x >> 40) as f32 / (1u64 << 24) as f32)
                })
                .collect::<Vec<f32>>()
        };
        let peaked = draw(|u| (12.0 * u * u * u * 4.0).round() / 4.0);
        let mut flat = draw(|u| (2.0 * u * 16.0).round() / 16.0);
        flat[0] = 2.5;
        for logits in [peaked, flat] {
            // The rules applied to the whole vocabulary sorted best first, in
            // f32 as the sampler computes them: the probabilities' sum in
            // vocabulary order, top-p's running sum best first.
            let reference = |top_k: usize, top_p: f32, min_p: f32| -> Vec<u32> {
                let mut c: Vec<(u32, f32)> = logits
                    .iter()
                    .enumerate()
                    .map(|(i, &l)| (i as u32, l))
                    .collect();
                let max = logits.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                let sum_in_vocab_order: f32 = logits.iter().map(|&l| fast_exp(l - max)).sum();
                c.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
                if top_k > 0 {
                    c.truncate(top_k);
                }
                let pr: Vec<f32> = c.iter().map(|c| fast_exp(c.1 - max)).collect();
                let total = if top_k > 0 {
                    pr.iter().sum()
                } else {
                    sum_in_vocab_order
                };
                let mut keep = c.len();
                if top_p < 1.0 {
                    let mut cum = 0.0;
                    keep = pr
                        .iter()
                        .position(|p| {
                            cum += p / total;
                            cum >= top_p
                        })
                        .map_or(keep, |i| i + 1);
                }
                if min_p > 0.0 {
                    keep = pr[..keep]
                        .iter()
                        .take_while(|&&p| p >= min_p)
                        .count()
                        .max(1);
                }
                let mut ids: Vec<u32> = c[..keep].iter().map(|c| c.0).collect();
                ids.sort();
                ids
            };
            for (top_k, top_p, min_p) in [
                (0, 1.0, 0.0),
                (0, 0.9, 0.0),
                (0, 0.5, 0.0),
                (0, 0.999, 0.0),
                (0, 1.0, 0.05),
                (0, 0.95, 0.01),
                (40, 0.95, 0.0),
                (3000, 1.0, 0.0),
            ] {
                let mut s = Sampler::new(SamplingParams {
                    temperature: 1.0,
                    top_k,
                    top_p,
                    min_p,
                    ..Default::default()
                });
                s.candidates = logits
                    .iter()
                    .enumerate()
                    .map(|(i, &l)| (i as u32, l))
                    .collect();
                let (keep, max) = s.cut();
                assert_eq!(max, logits.iter().fold(f32::MIN, |a, &b| a.max(b)));
                let mut ids: Vec<u32> = s.candidates[..keep].iter().map(|c| c.0).collect();
                ids.sort();
                assert_eq!(
                    ids,
                    reference(top_k, top_p, min_p),
                    "top-k {top_k}, top-p {top_p}, min-p {min_p}"
                );
            }
        }
    }

    #[test]
    fn the_sampler_exp_is_within_3e_7_of_e_to_the_x() {
        let mut worst = 0f64;
        for i in 0..=200_000 {
            let x = -87.0 + 88.0 * i as f32 / 200_000.0;
            let want = (x as f64).exp();
            worst = worst.max(((fast_exp(x) as f64) - want).abs() / want);
        }
        assert!(worst < 3e-7, "worst relative error {worst}");
        assert_eq!(fast_exp(0.0), 1.0);
        assert_eq!(fast_exp(-88.0), 0.0);
        assert_eq!(fast_exp(f32::NEG_INFINITY), 0.0);
        assert!(fast_exp(88.0).is_finite() && fast_exp(88.0) > 1e38);
    }

    #[test]
    fn top_k_keeps_the_k_best_with_ties_broken_by_id() {
        // Logits 0..6 repeating: the best value, 6, belongs to ids 6, 13,
        // ..., 97; the 10 best are the 10 smallest of those ids.
        let logits: Vec<f32> = (0..100).map(|i| (i % 7) as f32).collect();
        let want: Vec<u32> = (0..100).filter(|i| i % 7 == 6).take(10).collect();
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_k: 10,
            seed: 3,
            ..Default::default()
        });
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..2000 {
            seen.insert(s.sample(&logits, &[]));
        }
        assert_eq!(seen.into_iter().collect::<Vec<_>>(), want);
    }

    /// An infinite logit leaves min-p one candidate, itself, whether the
    /// vocabulary is sorted whole or filtered unsorted.
    #[test]
    fn min_p_keeps_an_infinite_best_logit() {
        for (n, top_p) in [(100, 1.0), (5000, 1.0), (5000, 0.9)] {
            let mut logits = vec![0.5f32; n];
            logits[n / 3] = f32::INFINITY;
            let mut s = Sampler::new(SamplingParams {
                temperature: 1.0,
                top_k: 0,
                top_p,
                min_p: 0.05,
                ..Default::default()
            });
            assert_eq!(
                s.sample(&logits, &[]),
                (n / 3) as u32,
                "{n} logits, top-p {top_p}"
            );
        }
    }

    #[test]
    fn top_p_and_min_p_restrict_the_support() {
        // top-p 0.5: token 1 alone has p ~ 0.37 < 0.5, adding token 5 passes.
        let params = SamplingParams {
            temperature: 1.0,
            top_p: 0.5,
            seed: 1,
            ..Default::default()
        };
        let mut s = Sampler::new(params);
        for _ in 0..200 {
            let t = s.sample(&logits(), &[]);
            assert!(t == 1 || t == 5, "{t}");
        }
        // min-p 0.7: exp(2.5-3) = 0.61 < 0.7, exp(-0.1) = 0.905 >= 0.7.
        let params = SamplingParams {
            temperature: 1.0,
            min_p: 0.7,
            seed: 2,
            ..Default::default()
        };
        let mut s = Sampler::new(params);
        let mut seen = [0u32; 6];
        for _ in 0..400 {
            seen[s.sample(&logits(), &[]) as usize] += 1;
        }
        assert!(seen[1] > 0 && seen[5] > 0);
        assert_eq!(seen[0] + seen[2] + seen[3] + seen[4], 0);
    }

    #[test]
    fn seeded_sampling_is_deterministic_and_follows_the_distribution() {
        let params = SamplingParams {
            temperature: 1.0,
            seed: 42,
            ..Default::default()
        };
        let draw = |p: &SamplingParams| {
            let mut s = Sampler::new(p.clone());
            (0..4000)
                .map(|_| s.sample(&logits(), &[]))
                .collect::<Vec<_>>()
        };
        let a = draw(&params);
        assert_eq!(a, draw(&params));
        let b = draw(&SamplingParams {
            seed: 43,
            ..params.clone()
        });
        assert_ne!(a, b);
        // Empirical frequency of token 1 vs its softmax probability.
        let l = logits();
        let z: f32 = l.iter().map(|x| x.exp()).sum();
        let p1 = 3.0f32.exp() / z;
        let f1 = a.iter().filter(|&&t| t == 1).count() as f32 / a.len() as f32;
        assert!((f1 - p1).abs() < 0.03, "{f1} vs {p1}");
    }

    #[test]
    fn low_temperature_concentrates() {
        let params = SamplingParams {
            temperature: 0.01,
            seed: 5,
            ..Default::default()
        };
        let mut s = Sampler::new(params);
        for _ in 0..100 {
            assert_eq!(s.sample(&logits(), &[]), 1);
        }
    }

    #[test]
    fn logprobs_are_the_log_softmax_with_sorted_alternatives() {
        let l = logits();
        let z: f64 = l.iter().map(|&x| (x as f64).exp()).sum();
        let lp = token_logprob(&l, 2, 3);
        assert_eq!(lp.token, 2);
        assert!((lp.logprob as f64 - (2.5f64 - z.ln())).abs() < 1e-6);
        let ids: Vec<u32> = lp.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, vec![1, 5, 2]);
        for &(t, v) in &lp.top {
            assert!((v as f64 - (l[t as usize] as f64 - z.ln())).abs() < 1e-6);
        }
        // Probabilities over the whole vocabulary sum to one.
        let all = token_logprob(&l, 0, 99);
        assert_eq!(all.top.len(), l.len());
        let total: f64 = all.top.iter().map(|t| (t.1 as f64).exp()).sum();
        assert!((total - 1.0).abs() < 1e-6);
        // Ties keep the lower id first; none asked, none given.
        let tie = token_logprob(&[1.0, 3.0, 3.0, 0.0], 2, 2);
        assert_eq!(tie.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 2]);
        assert!(token_logprob(&l, 1, 0).top.is_empty());
        // At most MAX_TOP_LOGPROBS alternatives.
        let wide: Vec<f32> = (0..100).map(|i| i as f32 * 0.01).collect();
        assert_eq!(token_logprob(&wide, 0, 50).top.len(), MAX_TOP_LOGPROBS);
    }

    #[test]
    fn a_mask_limits_every_sampling_mode() {
        let mut mask = crate::constraint::TokenMask::new(6);
        mask.allow(0);
        mask.allow(4);
        // Greedy picks the best allowed token, not the best token.
        let mut s = Sampler::new(SamplingParams::default());
        assert_eq!(s.sample_masked(&logits(), &[], Some(&mask)), Some(0));
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.5,
            top_k: 3,
            seed: 3,
            ..Default::default()
        });
        for _ in 0..200 {
            let t = s.sample_masked(&logits(), &[], Some(&mask)).unwrap();
            assert!(t == 0 || t == 4, "{t}");
        }
        mask.clear();
        assert_eq!(s.sample_masked(&logits(), &[], Some(&mask)), None);
    }

    #[test]
    fn stop_strings_find_and_hold_back() {
        let s = StopStrings::new(["</s>", "\nUser:"]);
        assert_eq!(s.check("hello"), StopCheck::Emit(5));
        assert_eq!(s.check("hello</"), StopCheck::Emit(5));
        assert_eq!(s.check("hello\nUs"), StopCheck::Emit(5));
        assert_eq!(s.check("hi</s> more"), StopCheck::Stop(2));
        assert_eq!(s.check("a\nUser: b</s>"), StopCheck::Stop(1));
        assert_eq!(StopStrings::default().check("x<"), StopCheck::Emit(2));
    }
}
