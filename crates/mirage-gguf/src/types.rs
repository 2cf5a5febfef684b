//! The one table of ggml tensor types that every layer reads (block size,
//! bytes per block, GGUF type id). Codecs live in [`crate::quant`].

use std::fmt;

/// A ggml tensor element type, with the numeric id GGUF stores on disk.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u32)]
pub enum GgmlType {
    /// 32-bit float.
    F32 = 0,
    /// IEEE half.
    F16 = 1,
    /// 4-bit, one f16 scale per 32.
    Q4_0 = 2,
    /// 4-bit, f16 scale and min per 32.
    Q4_1 = 3,
    /// 5-bit, one f16 scale per 32.
    Q5_0 = 6,
    /// 5-bit, f16 scale and min per 32.
    Q5_1 = 7,
    /// 8-bit, one f16 scale per 32.
    Q8_0 = 8,
    /// 8-bit with scale and sum per 32 (activations).
    Q8_1 = 9,
    /// 2-bit K-quant super-block of 256.
    Q2_K = 10,
    /// 3-bit K-quant super-block of 256.
    Q3_K = 11,
    /// 4-bit K-quant super-block of 256.
    Q4_K = 12,
    /// 5-bit K-quant super-block of 256.
    Q5_K = 13,
    /// 6-bit K-quant super-block of 256.
    Q6_K = 14,
    /// 8-bit K-quant (activations for K-quant dots).
    Q8_K = 15,
    /// bfloat16.
    BF16 = 30,
}

/// Elements per K-quant super-block.
pub const QK_K: usize = 256;

impl GgmlType {
    /// Every type this crate knows, in id order.
    pub const ALL: [GgmlType; 15] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q8_1,
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::Q8_K,
        GgmlType::BF16,
    ];

    /// Looks a GGUF type id up; `None` for ids this crate does not know.
    pub fn from_id(id: u32) -> Option<GgmlType> {
        GgmlType::ALL.iter().copied().find(|t| *t as u32 == id)
    }

    /// The GGUF on-disk id.
    pub fn id(self) -> u32 {
        self as u32
    }

    /// Elements per block.
    pub fn block_size(self) -> usize {
        use GgmlType::*;
        match self {
            F32 | F16 | BF16 => 1,
            Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q8_1 => 32,
            Q2_K | Q3_K | Q4_K | Q5_K | Q6_K | Q8_K => QK_K,
        }
    }

    /// Bytes per block.
    pub fn type_size(self) -> usize {
        use GgmlType::*;
        match self {
            F32 => 4,
            F16 | BF16 => 2,
            Q4_0 => 2 + 16,
            Q4_1 => 2 + 2 + 16,
            Q5_0 => 2 + 4 + 16,
            Q5_1 => 2 + 2 + 4 + 16,
            Q8_0 => 2 + 32,
            Q8_1 => 4 + 32,
            Q2_K => 16 + 64 + 2 + 2,
            Q3_K => 32 + 64 + 12 + 2,
            Q4_K => 2 + 2 + 12 + 128,
            Q5_K => 2 + 2 + 12 + 32 + 128,
            Q6_K => 128 + 64 + 16 + 2,
            Q8_K => 4 + 256 + 32,
        }
    }

    /// Whether this is a block-quantized type (not F32/F16/BF16).
    pub fn is_quantized(self) -> bool {
        self.block_size() > 1
    }

    /// Bytes needed for `n_elements` elements, or `None` when `n_elements`
    /// is not a whole number of blocks or the size overflows.
    pub fn bytes_for(self, n_elements: u64) -> Option<u64> {
        let bs = self.block_size() as u64;
        if !n_elements.is_multiple_of(bs) {
            return None;
        }
        (n_elements / bs).checked_mul(self.type_size() as u64)
    }

    /// The lower-case name llama.cpp uses (`q4_k`, `f16`, ...).
    pub fn name(self) -> &'static str {
        use GgmlType::*;
        match self {
            F32 => "f32",
            F16 => "f16",
            BF16 => "bf16",
            Q4_0 => "q4_0",
            Q4_1 => "q4_1",
            Q5_0 => "q5_0",
            Q5_1 => "q5_1",
            Q8_0 => "q8_0",
            Q8_1 => "q8_1",
            Q2_K => "q2_k",
            Q3_K => "q3_k",
            Q4_K => "q4_k",
            Q5_K => "q5_k",
            Q6_K => "q6_k",
            Q8_K => "q8_k",
        }
    }

    /// Parses a name as [`GgmlType::name`] writes it (case-insensitive).
    pub fn from_name(s: &str) -> Option<GgmlType> {
        let s = s.to_ascii_lowercase();
        GgmlType::ALL.iter().copied().find(|t| t.name() == s)
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name().to_ascii_uppercase())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_sizes_match_ggml() {
        for t in GgmlType::ALL {
            assert_eq!(GgmlType::from_id(t.id()), Some(t));
            assert_eq!(GgmlType::from_name(t.name()), Some(t));
        }
        // Sizes from ggml.c's type_traits table.
        assert_eq!(GgmlType::Q4_K.type_size(), 144);
        assert_eq!(GgmlType::Q6_K.type_size(), 210);
        assert_eq!(GgmlType::Q2_K.type_size(), 84);
        assert_eq!(GgmlType::Q3_K.type_size(), 110);
        assert_eq!(GgmlType::Q5_K.type_size(), 176);
        assert_eq!(GgmlType::Q8_K.type_size(), 292);
        assert_eq!(GgmlType::from_id(4), None);
        assert_eq!(GgmlType::Q8_0.bytes_for(33), None);
        assert_eq!(GgmlType::Q8_0.bytes_for(64), Some(68));
    }
}
