//! SentencePiece's precompiled character map (`tokenizer.ggml.precompiled_charsmap`): the
//! normalization rules (NFKC and friends) a Unigram vocabulary was trained with, compiled into a
//! double-array trie over UTF-8 bytes plus a blob of NUL-terminated replacement strings.
//!
//! Layout (little-endian): `u32` trie size in bytes, then the trie as `u32` units, then the
//! replacements. A trie unit packs BASE (bits 10..31, shifted left by 8 when bit 9 is set), LCHECK
//! (bits 0..7, plus bit 31 which marks value units so they never match a byte) and LEAF (bit 8).
//! Walking from the root, the node of byte `c` below node `n` is `n ^ BASE(n) ^ c`; a leaf's BASE
//! points at a unit whose low 31 bits are the offset of the replacement. This is SentencePiece's
//! `normalizer.cc` (Darts-clone) as llama.cpp's `llm_tokenizer_ugm` reads it. Every index is
//! checked, so a corrupt map is an error at load time or no match, never a panic.

use crate::TokenizerError;

/// A parsed precompiled character map.
#[derive(Debug, Clone, Default)]
pub(crate) struct CharsMap {
    trie: Vec<u32>,
    replacements: Vec<u8>,
}

impl CharsMap {
    /// Parse the metadata bytes; an empty slice is a map that never matches.
    pub(crate) fn parse(bytes: &[u8]) -> Result<CharsMap, TokenizerError> {
        if bytes.is_empty() {
            return Ok(CharsMap::default());
        }
        let bad = |reason: String| TokenizerError::BadMetadata {
            key: "tokenizer.ggml.precompiled_charsmap",
            reason,
        };
        let header: [u8; 4] = bytes
            .get(..4)
            .and_then(|h| h.try_into().ok())
            .ok_or_else(|| bad(format!("{} bytes, shorter than its header", bytes.len())))?;
        let trie_bytes = u32::from_le_bytes(header) as usize;
        let rest = &bytes[4..];
        if !trie_bytes.is_multiple_of(4) || trie_bytes >= rest.len() {
            return Err(bad(format!(
                "trie of {trie_bytes} bytes does not fit the {} bytes after the header",
                rest.len()
            )));
        }
        let trie = rest[..trie_bytes]
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        Ok(CharsMap {
            trie,
            replacements: rest[trie_bytes..].to_vec(),
        })
    }

    fn unit(&self, index: u32) -> Option<u32> {
        self.trie.get(index as usize).copied()
    }

    fn base(unit: u32) -> u32 {
        (unit >> 10) << ((unit & (1 << 9)) >> 6)
    }

    /// The longest prefix of `input` the map rewrites: `(bytes consumed, replacement)`.
    pub(crate) fn longest_match(&self, input: &[u8]) -> Option<(usize, &[u8])> {
        let mut node = Self::base(self.unit(0)?);
        let mut best = None;
        for (i, &c) in input.iter().enumerate() {
            if c == 0 {
                break;
            }
            node ^= u32::from(c);
            let unit = self.unit(node)?;
            // LCHECK: this unit must be the child labelled `c`.
            if unit & ((1 << 31) | 0xff) != u32::from(c) {
                break;
            }
            let is_leaf = (unit >> 8) & 1 == 1;
            node ^= Self::base(unit);
            if is_leaf {
                let value = self.unit(node)? & ((1 << 31) - 1);
                best = Some((i + 1, value as usize));
            }
        }
        let (consumed, offset) = best?;
        let tail = self.replacements.get(offset..)?;
        let end = tail.iter().position(|&b| b == 0)?;
        Some((consumed, &tail[..end]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn corrupt_maps_are_errors_or_no_match() {
        assert!(CharsMap::parse(&[1, 0]).is_err());
        assert!(CharsMap::parse(&[8, 0, 0, 0, 1, 2, 3, 4]).is_err());
        // A one-unit trie whose root points nowhere: no match, no panic.
        let map = CharsMap::parse(&[4, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0]).unwrap();
        assert_eq!(map.longest_match(b"abc"), None);
        assert!(CharsMap::default().longest_match(b"abc").is_none());
    }
}
