//! Byte-level mutations (the AFL/libFuzzer "havoc" set): flip a bit, set a
//! byte, write an interesting integer, add a small delta, delete, insert or
//! duplicate a chunk, write a dictionary word, splice in part of another
//! input. A target may add its own structure-aware mutation on top.

use crate::Rng;

/// Applies 1 to 8 random mutations to `data`, keeping it at most `max_len`
/// bytes. `other` is another corpus input to splice from.
pub fn havoc(data: &mut Vec<u8>, other: &[u8], dict: &[&[u8]], max_len: usize, rng: &mut Rng) {
    let n = 1 << rng.below(4);
    for _ in 0..n {
        one(data, other, dict, rng);
    }
    data.truncate(max_len);
}

fn one(data: &mut Vec<u8>, other: &[u8], dict: &[&[u8]], rng: &mut Rng) {
    if data.is_empty() {
        data.push(rng.next_u64() as u8);
        return;
    }
    let len = data.len();
    let at = rng.below(len);
    match rng.below(12) {
        0 => data[at] ^= 1 << rng.below(8),
        1 => data[at] = rng.next_u64() as u8,
        2 => {
            // An interesting integer, little-endian, of 1, 2, 4 or 8 bytes.
            let width = 1 << rng.below(4);
            let v = rng.interesting().to_le_bytes();
            let end = (at + width).min(len);
            data[at..end].copy_from_slice(&v[..end - at]);
        }
        3 => {
            // A small delta on a u8/u32/u64 field.
            let width = [1, 4, 8][rng.below(3)];
            if at + width <= len {
                let mut b = [0u8; 8];
                b[..width].copy_from_slice(&data[at..at + width]);
                let delta = rng.below(35) as u64;
                let v = if rng.one_in(2) {
                    u64::from_le_bytes(b).wrapping_add(delta)
                } else {
                    u64::from_le_bytes(b).wrapping_sub(delta)
                };
                data[at..at + width].copy_from_slice(&v.to_le_bytes()[..width]);
            }
        }
        4 => {
            let n = 1 + rng.below((len - at).min(64));
            data.drain(at..at + n);
        }
        5 => {
            let n = 1 + rng.below(16);
            let bytes: Vec<u8> = (0..n).map(|_| rng.next_u64() as u8).collect();
            data.splice(at..at, bytes);
        }
        6 => {
            // Duplicate a chunk in place.
            let n = 1 + rng.below((len - at).min(256));
            let chunk = data[at..at + n].to_vec();
            data.splice(at..at, chunk);
        }
        7 => {
            // Copy a chunk over another place.
            let n = 1 + rng.below((len - at).min(64));
            let chunk = data[at..at + n].to_vec();
            let to = rng.below(len);
            let end = (to + n).min(len);
            data[to..end].copy_from_slice(&chunk[..end - to]);
        }
        8 | 9 if !dict.is_empty() => {
            let word = *rng.pick(dict);
            if rng.one_in(2) {
                data.splice(at..at, word.iter().copied());
            } else {
                let end = (at + word.len()).min(len);
                data[at..end].copy_from_slice(&word[..end - at]);
            }
        }
        10 if !other.is_empty() => {
            // Splice: our head, their tail.
            let from = rng.below(other.len());
            data.truncate(at);
            data.extend_from_slice(&other[from..]);
        }
        11 => data.truncate(at.max(1)),
        _ => data[at] = data[at].wrapping_add(1),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn havoc_changes_inputs_and_keeps_the_length_bound() {
        let mut rng = Rng::new(1);
        let seed = b"GGUF\x03\x00\x00\x00 some bytes to mutate".to_vec();
        let mut changed = 0;
        for _ in 0..1000 {
            let mut d = seed.clone();
            havoc(&mut d, b"other input", &[b"{{", b"}}"], 64, &mut rng);
            assert!(d.len() <= 64);
            changed += usize::from(d != seed);
        }
        assert!(changed > 900, "{changed}");
    }
}
