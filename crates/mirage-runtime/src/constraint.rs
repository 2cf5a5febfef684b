//! Constrained decoding: the seam through which a grammar limits the next
//! token.
//!
//! A [`Constraint`] (a compiled grammar, JSON schema, ...) starts one
//! [`ConstraintState`] per generation. Before each sample the state writes
//! the tokens it allows into a [`TokenMask`]; the sampler gives every other
//! token a logit of minus infinity, then samples as usual (penalties,
//! top-k/p, temperature); the sampled token is then handed back to
//! [`ConstraintState::accept`]. The mask is applied on the host, to the
//! logits the step already copies there for sampling, so a GPU backend does
//! no extra transfer or synchronisation for it.
//!
//! The runtime knows no grammar format: `mirage-grammar` implements these
//! traits with llguidance.

use std::fmt;

/// Allowed next tokens: one bit per token id, set = allowed. Ids at or
/// past [`TokenMask::len`] (e.g. padding rows of the lm head past the
/// tokenizer's vocabulary) are never allowed.
#[derive(Clone, PartialEq, Eq)]
pub struct TokenMask {
    words: Vec<u32>,
    len: usize,
}

impl fmt::Debug for TokenMask {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TokenMask")
            .field("len", &self.len)
            .field("allowed", &self.count())
            .finish()
    }
}

impl TokenMask {
    /// A mask over `len` token ids with none allowed.
    pub fn new(len: usize) -> TokenMask {
        TokenMask {
            words: vec![0; len.div_ceil(32)],
            len,
        }
    }

    /// Token ids the mask covers.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it covers no id.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Disallows every token.
    pub fn clear(&mut self) {
        self.words.fill(0);
    }

    /// Allows `id` (ignored past the end).
    pub fn allow(&mut self, id: u32) {
        let i = id as usize;
        if i < self.len {
            self.words[i / 32] |= 1 << (i % 32);
        }
    }

    /// Disallows `id`.
    pub fn forbid(&mut self, id: u32) {
        let i = id as usize;
        if i < self.len {
            self.words[i / 32] &= !(1 << (i % 32));
        }
    }

    /// Whether `id` is allowed.
    #[inline]
    pub fn is_allowed(&self, id: u32) -> bool {
        let i = id as usize;
        i < self.len && self.words[i / 32] >> (i % 32) & 1 == 1
    }

    /// Number of allowed tokens.
    pub fn count(&self) -> usize {
        self.words.iter().map(|w| w.count_ones() as usize).sum()
    }

    /// The bit words, 32 ids each, id `i` at bit `i % 32` of word `i / 32`
    /// (llguidance's and ggml's layout). Bits past [`TokenMask::len`] must
    /// stay zero.
    pub fn words_mut(&mut self) -> &mut [u32] {
        &mut self.words
    }

    /// Sets every logit of a disallowed token to minus infinity. Returns
    /// whether any token is still allowed.
    pub fn apply(&self, logits: &mut [f32]) -> bool {
        let mut any = false;
        for (w, chunk) in logits.chunks_mut(32).enumerate() {
            let bits = self.words.get(w).copied().unwrap_or(0);
            if bits == u32::MAX && chunk.len() == 32 {
                any = true;
                continue;
            }
            any |= bits != 0;
            for (b, l) in chunk.iter_mut().enumerate() {
                if bits >> b & 1 == 0 {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        any
    }
}

/// Why a constraint failed (a grammar that cannot compile, or a token it
/// did not allow).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ConstraintError(pub String);

/// A rule over whole generations that can start a fresh
/// [`ConstraintState`] for each one (shared between sequences: `Sync`).
pub trait Constraint: Send + Sync + fmt::Debug {
    /// The state at the start of a generation.
    fn start(&self) -> Result<Box<dyn ConstraintState>, ConstraintError>;
}

/// Where one generation stands in its constraint.
pub trait ConstraintState: Send {
    /// Writes the tokens allowed next into `mask` (cleared first by the
    /// caller; its length is the logits' vocabulary). End-of-generation
    /// tokens are allowed only where the constraint may end; when nothing
    /// is allowed, generation ends.
    fn fill_mask(&mut self, mask: &mut TokenMask) -> Result<(), ConstraintError>;
    /// Advances past `token`, which the last mask allowed and which is not
    /// an end-of-generation token.
    fn accept(&mut self, token: u32) -> Result<(), ConstraintError>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mask_bits_and_apply() {
        let mut m = TokenMask::new(70);
        assert_eq!(m.count(), 0);
        m.allow(0);
        m.allow(33);
        m.allow(69);
        m.allow(70); // past the end: ignored
        assert_eq!(m.count(), 3);
        assert!(m.is_allowed(33) && !m.is_allowed(34) && !m.is_allowed(70));
        let mut logits: Vec<f32> = (0..75).map(|i| i as f32).collect();
        assert!(m.apply(&mut logits));
        let kept: Vec<usize> = (0..75).filter(|&i| logits[i].is_finite()).collect();
        assert_eq!(kept, vec![0, 33, 69]);
        m.forbid(33);
        assert!(!m.is_allowed(33));
        m.clear();
        assert!(!m.apply(&mut logits));
    }
}
