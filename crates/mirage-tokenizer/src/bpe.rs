//! The BPE merge loop over token ids.
//!
//! A piece starts as one symbol per byte (the byte's token id); the adjacent pair with the lowest merge
//! rank is merged, leftmost first among equal ranks, until no adjacent pair has a merge. This is the
//! order Hugging Face tokenizers' `Word::merge_all` uses: a min-heap of (rank, position) whose stale
//! entries are skipped when popped, so a piece of n bytes costs O(n log n).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::Mutex;

use crate::TokenizerError;

/// The pieces cached at most; the cache is emptied when it grows past this (a simple bound that
/// keeps memory flat on adversarial input while normal text, which repeats pieces, stays hot).
const CACHE_CAPACITY: usize = 1 << 16;

/// Pieces longer than this (bytes) bypass the cache: they rarely repeat.
const CACHE_MAX_PIECE_LEN: usize = 64;

/// Token ids of recently merged pieces, keyed by the piece's bytes.
type PieceCache = HashMap<Box<[u8]>, Box<[u32]>>;

/// Heap entry: (rank, left position, left id, right id); `Reverse` makes the heap a min-heap.
type PairEntry = Reverse<(u32, usize, u32, u32)>;

#[derive(Debug, Clone, Copy)]
struct Merge {
    rank: u32,
    merged: u32,
}

/// Merge table plus the per-byte starting symbols.
#[derive(Debug)]
pub(crate) struct Bpe {
    merges: HashMap<(u32, u32), Merge>,
    byte_ids: [Option<u32>; 256],
    unknown_id: Option<u32>,
    cache: Mutex<PieceCache>,
}

#[derive(Debug, Clone, Copy)]
struct Symbol {
    id: u32,
    prev: usize,
    next: usize,
    alive: bool,
}

const NONE: usize = usize::MAX;

impl Bpe {
    /// `merges` are (left id, right id, merged id) in rank order.
    pub(crate) fn new(
        merges: impl IntoIterator<Item = (u32, u32, u32)>,
        byte_ids: [Option<u32>; 256],
        unknown_id: Option<u32>,
    ) -> Bpe {
        let mut table = HashMap::new();
        for (rank, (left, right, merged)) in merges.into_iter().enumerate() {
            // The first occurrence of a pair wins, as in a rank list read top to bottom.
            table.entry((left, right)).or_insert(Merge {
                rank: rank as u32,
                merged,
            });
        }
        Bpe {
            merges: table,
            byte_ids,
            unknown_id,
            cache: Mutex::new(HashMap::new()),
        }
    }

    /// Forget every cached piece (benchmarks use this to time a cold start).
    pub(crate) fn clear_cache(&self) {
        if let Ok(mut cache) = self.cache.lock() {
            cache.clear();
        }
    }

    /// Append the token ids of one pre-tokenized piece to `out`.
    pub(crate) fn encode_piece(
        &self,
        piece: &[u8],
        out: &mut Vec<u32>,
    ) -> Result<(), TokenizerError> {
        let cacheable = piece.len() <= CACHE_MAX_PIECE_LEN;
        if cacheable {
            if let Ok(cache) = self.cache.lock() {
                if let Some(ids) = cache.get(piece) {
                    out.extend_from_slice(ids);
                    return Ok(());
                }
            }
        }
        let start = out.len();
        self.merge_piece(piece, out)?;
        if cacheable {
            if let Ok(mut cache) = self.cache.lock() {
                if cache.len() >= CACHE_CAPACITY {
                    cache.clear();
                }
                cache.insert(piece.into(), out[start..].into());
            }
        }
        Ok(())
    }

    fn merge_piece(&self, piece: &[u8], out: &mut Vec<u32>) -> Result<(), TokenizerError> {
        let mut symbols = Vec::with_capacity(piece.len());
        for (i, &b) in piece.iter().enumerate() {
            let id = self.byte_ids[b as usize]
                .or(self.unknown_id)
                .ok_or(TokenizerError::UnencodableByte(b))?;
            symbols.push(Symbol {
                id,
                prev: if i == 0 { NONE } else { i - 1 },
                next: if i + 1 == piece.len() { NONE } else { i + 1 },
                alive: true,
            });
        }
        if symbols.len() > 1 {
            let mut heap = BinaryHeap::with_capacity(symbols.len());
            for i in 0..symbols.len() - 1 {
                self.push_pair(&symbols, i, &mut heap);
            }
            while let Some(Reverse((rank, pos, left_id, right_id))) = heap.pop() {
                let left = symbols[pos];
                // Skip entries made stale by earlier merges.
                if !left.alive || left.id != left_id || left.next == NONE {
                    continue;
                }
                let right_pos = left.next;
                let right = symbols[right_pos];
                if right.id != right_id {
                    continue;
                }
                let Some(merge) = self.merges.get(&(left_id, right_id)) else {
                    continue;
                };
                debug_assert_eq!(merge.rank, rank);
                symbols[pos].id = merge.merged;
                symbols[pos].next = right.next;
                symbols[right_pos].alive = false;
                if right.next != NONE {
                    symbols[right.next].prev = pos;
                }
                if left.prev != NONE {
                    self.push_pair(&symbols, left.prev, &mut heap);
                }
                self.push_pair(&symbols, pos, &mut heap);
            }
        }
        let mut i = if symbols.is_empty() { NONE } else { 0 };
        while i != NONE {
            out.push(symbols[i].id);
            i = symbols[i].next;
        }
        Ok(())
    }

    fn push_pair(&self, symbols: &[Symbol], pos: usize, heap: &mut BinaryHeap<PairEntry>) {
        let next = symbols[pos].next;
        if next == NONE {
            return;
        }
        let pair = (symbols[pos].id, symbols[next].id);
        if let Some(m) = self.merges.get(&pair) {
            heap.push(Reverse((m.rank, pos, pair.0, pair.1)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Vocabulary: bytes a=0, b=1, c=2; "ab"=3, "bc"=4, "abc"=5.
    fn toy() -> Bpe {
        let mut byte_ids = [None; 256];
        byte_ids[b'a' as usize] = Some(0);
        byte_ids[b'b' as usize] = Some(1);
        byte_ids[b'c' as usize] = Some(2);
        Bpe::new([(1, 2, 4), (0, 1, 3), (0, 4, 5)], byte_ids, None)
    }

    #[test]
    fn lowest_rank_merges_first() {
        let bpe = toy();
        let mut out = Vec::new();
        // "bc" (rank 0) beats "ab" (rank 1); then a + bc -> abc.
        bpe.encode_piece(b"abc", &mut out).unwrap();
        assert_eq!(out, vec![5]);
        out.clear();
        bpe.encode_piece(b"abab", &mut out).unwrap();
        assert_eq!(out, vec![3, 3]);
        out.clear();
        // Cached path gives the same answer.
        bpe.encode_piece(b"abab", &mut out).unwrap();
        assert_eq!(out, vec![3, 3]);
    }

    #[test]
    fn missing_byte_is_an_error_without_unknown() {
        let bpe = toy();
        let mut out = Vec::new();
        assert!(matches!(
            bpe.encode_piece(b"az", &mut out),
            Err(TokenizerError::UnencodableByte(b'z'))
        ));
    }
}
