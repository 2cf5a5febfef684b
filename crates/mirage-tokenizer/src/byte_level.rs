//! GPT-2's reversible byte <-> printable-character mapping.
//!
//! Byte-level BPE vocabularies store every token as a string over 256 printable code points, one per
//! byte value (space is `Ġ`, newline is `Ċ`, ...), so that merges never see raw whitespace or invalid
//! UTF-8. This module converts both ways.

use std::collections::HashMap;
use std::sync::OnceLock;

/// The code point GPT-2 assigns to each byte value.
pub(crate) fn byte_to_char() -> &'static [char; 256] {
    static TABLE: OnceLock<[char; 256]> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut table = ['\0'; 256];
        let printable = |b: u32| {
            (u32::from(b'!')..=u32::from(b'~')).contains(&b)
                || (0xA1..=0xAC).contains(&b)
                || (0xAE..=0xFF).contains(&b)
        };
        let mut shifted = 0u32;
        for b in 0u32..256 {
            let code = if printable(b) {
                b
            } else {
                shifted += 1;
                255 + shifted
            };
            // All codes are below 0x200, valid scalar values.
            table[b as usize] = char::from_u32(code).unwrap_or('\u{FFFD}');
        }
        table
    })
}

/// The inverse of [`byte_to_char`].
pub(crate) fn char_to_byte() -> &'static HashMap<char, u8> {
    static MAP: OnceLock<HashMap<char, u8>> = OnceLock::new();
    MAP.get_or_init(|| {
        byte_to_char()
            .iter()
            .enumerate()
            .map(|(b, &c)| (c, b as u8))
            .collect()
    })
}

/// Raw bytes of a byte-level token string. Characters outside the mapping (which a well-formed
/// byte-level vocabulary never contains) keep their own UTF-8 bytes, as Hugging Face's ByteLevel
/// decoder does.
pub(crate) fn token_text_to_bytes(text: &str) -> Vec<u8> {
    let map = char_to_byte();
    let mut out = Vec::with_capacity(text.len());
    for c in text.chars() {
        match map.get(&c) {
            Some(&b) => out.push(b),
            None => {
                let mut buf = [0u8; 4];
                out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
            }
        }
    }
    out
}

/// The byte-level token string of one byte value.
pub(crate) fn byte_token_text(b: u8) -> String {
    byte_to_char()[b as usize].to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mapping_is_a_bijection_with_known_points() {
        let table = byte_to_char();
        assert_eq!(table[b' ' as usize], 'Ġ');
        assert_eq!(table[b'\n' as usize], 'Ċ');
        assert_eq!(table[b'a' as usize], 'a');
        assert_eq!(char_to_byte().len(), 256);
        for b in 0..=255u8 {
            assert_eq!(token_text_to_bytes(&byte_token_text(b)), vec![b]);
        }
    }
}
