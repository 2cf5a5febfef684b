//! One module per subcommand. Each exposes a `clap::Args` struct and
//! `pub fn run(args) -> anyhow::Result<()>`; `main.rs` only dispatches.
//! Small helpers several commands share live here.

pub mod bench;
pub mod bench_activation;
#[cfg(feature = "cuda")]
pub mod bench_activation_cuda;
pub mod bench_grammar;
pub mod bench_peer;
#[cfg(feature = "cuda")]
pub mod bench_sparse;
pub mod chat;
pub mod eval;
pub mod eval_activation;
pub mod eval_long;
pub mod fetch;
pub mod generate;
pub mod inspect;
pub mod perplexity;
pub mod progress;
pub mod quantize;
pub mod quantize_mix;

use mirage_gguf::GgmlType;

/// llama.cpp's `llama_ftype` name for a `general.file_type` value.
pub fn file_type_name(file_type: u64) -> Option<&'static str> {
    Some(match file_type {
        0 => "ALL_F32",
        1 => "MOSTLY_F16",
        2 => "MOSTLY_Q4_0",
        3 => "MOSTLY_Q4_1",
        7 => "MOSTLY_Q8_0",
        8 => "MOSTLY_Q5_0",
        9 => "MOSTLY_Q5_1",
        10 => "MOSTLY_Q2_K",
        11 => "MOSTLY_Q3_K_S",
        12 => "MOSTLY_Q3_K_M",
        13 => "MOSTLY_Q3_K_L",
        14 => "MOSTLY_Q4_K_S",
        15 => "MOSTLY_Q4_K_M",
        16 => "MOSTLY_Q5_K_S",
        17 => "MOSTLY_Q5_K_M",
        18 => "MOSTLY_Q6_K",
        32 => "MOSTLY_BF16",
        _ => return None,
    })
}

/// The `general.file_type` (llama.cpp `llama_ftype`) of a file whose weights
/// are mostly `ty`; `None` for types that are not weight formats (Q8_1, Q8_K).
/// Pure K-quant files get the `_S` ("small", mostly that type) variants.
pub fn file_type_of(ty: GgmlType) -> Option<u32> {
    use GgmlType::*;
    Some(match ty {
        F32 => 0,
        F16 => 1,
        Q4_0 => 2,
        Q4_1 => 3,
        Q8_0 => 7,
        Q5_0 => 8,
        Q5_1 => 9,
        Q2_K => 10,
        Q3_K => 11,
        Q4_K => 14,
        Q5_K => 16,
        Q6_K => 18,
        BF16 => 32,
        Q8_1 | Q8_K => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_types_round_trip_to_names_of_the_same_type() {
        for ty in GgmlType::ALL {
            if let Some(ft) = file_type_of(ty) {
                let name = file_type_name(ft as u64).unwrap();
                let upper = ty.name().to_ascii_uppercase();
                assert!(name.contains(&upper), "{ty}: {name}");
            }
        }
    }
}
