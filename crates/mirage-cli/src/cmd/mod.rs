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

#[cfg(test)]
mod tests {
    use super::*;
    use mirage_gguf::quant_mix::file_type_of;
    use mirage_gguf::GgmlType;

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
