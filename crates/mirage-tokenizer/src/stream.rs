//! Incremental decoding for streaming generation.
//!
//! One byte-level token may end in the middle of a multi-byte UTF-8 character (emoji and CJK text are
//! often split that way), so printing each token's bytes on its own would show replacement characters.
//! [`StreamDecoder`] buffers the incomplete tail and yields only complete text.

use crate::Tokenizer;

/// Accumulates token bytes and yields complete UTF-8 text.
#[derive(Debug, Default, Clone)]
pub struct StreamDecoder {
    pending: Vec<u8>,
}

impl StreamDecoder {
    /// An empty decoder.
    pub fn new() -> StreamDecoder {
        StreamDecoder::default()
    }

    /// Add one token's bytes; returns the text that is now complete (possibly empty).
    /// Bytes that can never start or continue a valid character become U+FFFD right away.
    pub fn push_bytes(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        let mut rest: &[u8] = &self.pending;
        loop {
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    out.push_str(s);
                    rest = &[];
                    break;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // The prefix up to `valid` is checked UTF-8.
                    out.push_str(std::str::from_utf8(&rest[..valid]).unwrap_or_default());
                    match e.error_len() {
                        Some(bad) => {
                            out.push('\u{FFFD}');
                            rest = &rest[valid + bad..];
                        }
                        // Incomplete character at the end: keep it for the next push.
                        None => {
                            rest = &rest[valid..];
                            break;
                        }
                    }
                }
            }
        }
        let keep = rest.len();
        let start = self.pending.len() - keep;
        self.pending.drain(..start);
        out
    }

    /// Add one token (its raw piece from `tokenizer`); returns the text that is now complete.
    pub fn push_token(&mut self, tokenizer: &Tokenizer, id: u32) -> String {
        self.push_bytes(tokenizer.token_to_piece(id))
    }

    /// Whether bytes of an unfinished character are waiting.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// End of stream: whatever is still buffered, with an unfinished character as U+FFFD.
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_multibyte_characters_across_pushes() {
        let text = "a😀é";
        let bytes = text.as_bytes();
        let mut d = StreamDecoder::new();
        let mut out = String::new();
        for b in bytes {
            out.push_str(&d.push_bytes(std::slice::from_ref(b)));
        }
        out.push_str(&d.finish());
        assert_eq!(out, text);
        assert_eq!(d.push_bytes(&[0xF0, 0x9F]), "");
        assert!(d.has_pending());
        assert_eq!(d.push_bytes(&[0xFF, b'x']), "\u{FFFD}\u{FFFD}x");
        assert_eq!(d.push_bytes(&[0xE2]), "");
        assert_eq!(d.finish(), "\u{FFFD}");
    }
}
